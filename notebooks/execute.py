"""Executes notebooks headless (nbclient), each from the notebooks/ folder.

Usage: python notebooks/execute.py NOTEBOOK.ipynb...
Reports and figure folders come from OMNIPREFIX_REPORTS / OMNIPREFIX_FIGURES (absolute paths).
A failing cell fails the run with the cell's traceback.
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(paths):
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
        print(f"executed {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
