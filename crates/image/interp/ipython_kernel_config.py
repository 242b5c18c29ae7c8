# IPython kernel settings of cordon's code-interpreter-v1 image (installed
# as /etc/ipython/ipython_kernel_config.py, read by every kernel).
c = get_config()  # noqa: F821 (provided by IPython when it loads this file)

# Tracebacks go to programs (agents), not terminals: no ANSI colour codes.
c.InteractiveShell.colors = "NoColor"

# Several kernels (contexts) share one home; a shared history database only
# brings "database is locked" warnings, and nobody reads it.
c.HistoryManager.enabled = False

# Figures come back as PNG display data at the end of the cell (ipykernel
# selects the inline backend when MPLBACKEND is unset). They keep exactly
# the size they were given (figsize * dpi pixels) and matplotlib's own
# defaults (6.4 x 4.8 in at 100 dpi, white background) rather than the
# inline backend's cropped, 72-dpi, transparent ones.
c.InlineBackend.rc = {}
c.InlineBackend.print_figure_kwargs = {"bbox_inches": None}
c.InlineBackend.figure_formats = {"png"}
