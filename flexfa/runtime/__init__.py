"""What every kernel generator shares at run time: launching compiled kernels and logging their
first compiles (launch.py), compile worker processes (workers.py, compile_worker.py), the disk
cache of generated modules (diskcache.py), the Jinja environment of the templates (jinja.py) and
the builder thread for what flexfa keeps between calls (persist.py)."""
