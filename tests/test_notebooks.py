"""The notebooks run top to bottom (executed with a real Jupyter kernel)."""

import pytest

from conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


@pytest.mark.slow
def test_explore_dataset_notebook_runs(tmp_path):
    notebook = nbformat.read(REPO / "notebooks" / "explore_dataset.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    html = [o for o in outputs if "text/html" in o.get("data", {})]
    assert html and "background:#b7f0b1" in html[0]["data"]["text/html"]  # trained tokens are highlighted
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the histograms
