"""The Jinja environment both backends render their kernel templates with."""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2


@functools.cache
def environment(template_dir: Path) -> jinja2.Environment:
    """The environment of the templates in `template_dir` (one per folder, made once): undefined
    names are errors, trailing newlines are kept, nothing is escaped (the output is Python)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
