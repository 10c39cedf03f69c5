"""The dump (`dump_dir`): one run's folder and its index (`folder.py`), and each graph's folder
with its stage files, report, kernel files and rerun script (`graphs.py`)."""

from seqcompile.dump.graphs import GraphDump

__all__ = ["GraphDump"]
