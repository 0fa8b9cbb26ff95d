"""Where the package's data files live: CUDA kernel sources, Hydra configs, the dashboard page.

They ship inside the package (pyproject.toml's package-data), so an editable checkout and a plain
`pip install .` find them the same way: next to this module, wherever the package is installed.
Nothing here depends on the current directory or on a source tree.
"""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
KERNEL_DIR = PACKAGE_DIR / "kernels"  # <op>.cu and common.cuh, compiled at run time by NVRTC
CONF_DIR = PACKAGE_DIR / "conf"  # Hydra: config.yaml, groups model/data/train/backend/eval/proxy, experiment/
DASHBOARD_PAGE = PACKAGE_DIR / "web" / "dashboard.html"  # the live loss page andrea.dashboard serves


def model_config(exp: str) -> Path:
    """conf/model/<exp>.yaml: the model shape of an experiment."""
    return CONF_DIR / "model" / f"{exp}.yaml"


def experiments() -> list:
    """Names of the experiments conf/experiment/ defines, sorted."""
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
