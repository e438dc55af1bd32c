"""Command line: `python -m flexfa export FILE.py:MOD [--mask MASK] --out DIR`, and
`python -m flexfa cache info|clear` for the disk caches (docs/cache.md).

Examples:

    python -m flexfa export my_mods.py:alibi --mask causal --num-heads 16 --out kernels/
    python -m flexfa export my_mods.py:relative_bias --mask "sliding_window(512)" --out k/
    python -m flexfa export none --mask my_masks.py:document_mask --out k/ --ptx 90
    python -m flexfa export alibi --mask causal --backend fa4 --arch sm_100a --out k/

MOD and MASK name a function in a Python file (FILE.py:NAME), optionally called with constant
arguments (FILE.py:softcap(30.0)); a bare NAME refers to flexfa.mods / flexfa.masks; `none` means
no score_mod. `--ptx ARCH` also compiles every kernel for sm_ARCH (no GPU needed) and writes PTX.
`--backend fa4 --arch sm_90a|sm_100a` writes the generated CuTe DSL hooks and the PTX of
FlashAttention-4's forward and backward kernels compiled with them (no GPU needed either).

    python -m flexfa cache info              # where the caches are, entries and size per backend
    python -m flexfa cache info --json
    python -m flexfa cache clear             # remove every backend's cache
    python -m flexfa cache clear --backend triton
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch


def _call_parts(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """'name' or 'name(1, x=2.0)' -> (name, args, kwargs); only literal arguments are allowed."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise SystemExit(f"flexfa export: cannot parse {text!r}") from None
    if isinstance(node, ast.Name):
        return node.id, [], {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            raise SystemExit(f"flexfa export: arguments in {text!r} must be literals") from None
        return node.func.id, args, kwargs
    raise SystemExit(f"flexfa export: expected NAME or NAME(args), got {text!r}")


def _load_file(path: str) -> Any:
    file = Path(path)
    if not file.exists():
        raise SystemExit(f"flexfa export: no such file {path}")
    spec = importlib.util.spec_from_file_location(f"flexfa_user_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def resolve(reference: str | None, default_namespace: Any) -> Any:
    """Turn 'FILE.py:NAME(args)' or 'NAME(args)' (in `default_namespace`) into the object."""
    if reference is None or reference.lower() == "none":
        return None
    if ".py:" in reference:
        path, _, expr = reference.partition(".py:")
        namespace = _load_file(path + ".py")
    else:
        namespace, expr = default_namespace, reference
    name, args, kwargs = _call_parts(expr)
    if not hasattr(namespace, name):
        raise SystemExit(
            f"flexfa export: {name!r} not found in {getattr(namespace, '__name__', namespace)}"
        )
    obj = getattr(namespace, name)
    return obj(*args, **kwargs) if (args or kwargs or expr.endswith(")")) else obj


def export_command(args: argparse.Namespace) -> int:
    if args.backend == "fa4":
        return _export_fa4(args)
    import flexfa
    from flexfa.export import compile_ptx, export_module

    score_mod = resolve(args.mod, flexfa.mods)
    mask_mod = resolve(args.mask, flexfa.masks)
    exported = export_module(
        score_mod, mask_mod, num_heads=args.num_heads, grad_captures=args.grad_captures
    )
    written = exported.write(args.out)
    if args.ptx:
        dtype = getattr(torch, args.dtype)
        ptx = compile_ptx(
            score_mod,
            mask_mod,
            num_heads=args.num_heads or 1,
            head_dim=args.head_dim,
            dtype=dtype,
            arch=args.ptx,
        )
        for name, text in ptx.items():
            path = Path(args.out) / f"{name}.sm_{args.ptx}.ptx"
            path.write_text(text)
            written.append(path)
    for path in written:
        print(path)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""  # pragma: no cover


def cache_command(args: argparse.Namespace) -> int:
    import json

    from flexfa.runtime import diskcache

    if args.action == "clear":
        try:
            removed = diskcache.clear(args.backend)
        except OSError as e:
            print(f"flexfa cache clear: {e}", file=sys.stderr)
            return 1
        for path in removed:
            print(f"removed {path}")
        if not removed:
            print("nothing to remove")
        return 0
    info = diskcache.info()
    if args.json:
        print(json.dumps(info.as_dict(), indent=1))
        return 0
    loc = info.location
    if loc.path is None:
        print(f"flexfa cache: memory only ({loc.configured} is not usable: {loc.reason})")
    elif loc.reason is not None:
        print(f"flexfa cache: {loc.path} ({loc.configured} is not used: {loc.reason})")
    else:
        print(f"flexfa cache: {loc.path}")
    print(f"{'backend':<10} {'entries':>7} {'files':>6} {'size':>9}  holds")
    for b in info.backends:
        extra = f"; also {', '.join(b.data_files)}" if b.data_files else ""
        print(
            f"{b.backend:<10} {b.entries:>7} {b.files:>6} {_size(b.bytes):>9}  "
            f"{diskcache.BACKENDS[b.backend]}{extra}"
        )
    print(
        "Triton keeps its compiled binaries in its own cache (TRITON_CACHE_DIR); fa4/ holds FA4's."
    )
    return 0


def _backend_list(text: str) -> list[str]:
    from flexfa.runtime.diskcache import BACKENDS

    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in BACKENDS:
            raise argparse.ArgumentTypeError(
                f"unknown backend {n!r}; expected one of {', '.join(sorted(BACKENDS))}"
            )
    return names


def _export_fa4(args: argparse.Namespace) -> int:
    from flexfa.codegen.cute import offline

    offline.configure_arch(args.arch)  # before anything imports the CuTe DSL
    import flexfa

    written = offline.export(
        resolve(args.mod, flexfa.mods),
        resolve(args.mask, flexfa.masks),
        arch=args.arch,
        out_dir=args.out,
        num_heads=args.num_heads or 4,
        head_dim=args.head_dim,
        dtype=getattr(torch, args.dtype),
    )
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexfa", description="flexfa tools")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the generated Triton kernels for a score_mod/mask")
    ex.add_argument("mod", help="score_mod: FILE.py:NAME, NAME in flexfa.mods, or none")
    ex.add_argument("--mask", default=None, help="mask_mod: FILE.py:NAME or NAME in flexfa.masks")
    ex.add_argument("--out", required=True, help="output directory")
    ex.add_argument(
        "--num-heads", type=int, default=None, help="for mods that depend on it (alibi)"
    )
    ex.add_argument(
        "--grad-captures",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="emit gradient scatters for captured float tensors (default: those requiring grad)",
    )
    ex.add_argument(
        "--ptx", type=int, default=None, metavar="ARCH", help="also write PTX for sm_ARCH, e.g. 90"
    )
    ex.add_argument("--head-dim", type=int, default=128, help="head dim for --ptx")
    ex.add_argument("--dtype", default="bfloat16", help="dtype for --ptx")
    ex.add_argument(
        "--backend", choices=("triton", "fa4"), default="triton", help="which kernels to export"
    )
    ex.add_argument(
        "--arch", choices=("sm_90a", "sm_100a"), default="sm_90a", help="arch for --backend fa4"
    )
    ca = sub.add_parser("cache", help="show or clear flexfa's disk caches")
    cache_sub = ca.add_subparsers(dest="action", required=True)
    info = cache_sub.add_parser("info", help="location, entries and size per backend")
    info.add_argument("--json", action="store_true", help="print JSON")
    clear = cache_sub.add_parser("clear", help="remove cached modules and tuning results")
    clear.add_argument(
        "--backend",
        type=_backend_list,
        action="extend",
        default=None,
        help="only these backends (repeat or separate with commas); default: all",
    )
    args = parser.parse_args(argv)
    if args.command == "export":
        return export_command(args)
    if args.command == "cache":
        return cache_command(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    raise SystemExit(main())
