"""Where the package's data files live: CUDA kernel sources, Hydra configs, the dashboard page.

In the repository the kernels and configs sit at the top level (`kernels/`, `conf/`), beside the
package; a built wheel maps them into it (pyproject.toml's package-dir: `andrea.kernels` is
`kernels/`, `andrea.conf` is `conf/`). So a source checkout (an editable install) finds them one
folder up, an installed package next to this module. Nothing here depends on the current
directory.
"""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str, marker: str) -> Path:
    """PACKAGE_DIR/name in an installed wheel (where it holds marker: a folder left empty there by
    an older checkout does not count), else the repository's top-level name/."""
    inside = PACKAGE_DIR / name
    return inside if (inside / marker).is_file() else PACKAGE_DIR.parent / name


KERNEL_DIR = _data_dir("kernels", "common.cuh")  # <op>.cu and common.cuh, compiled at run time by NVRTC
CONF_DIR = _data_dir("conf", "config.yaml")  # Hydra: config.yaml, groups model/data/train/backend/eval/proxy, experiment/
DASHBOARD_PAGE = PACKAGE_DIR / "web" / "dashboard.html"  # the live loss page andrea.pipeline.dashboard serves
CHAT_PAGE = PACKAGE_DIR / "web" / "chat.html"  # the chat page andrea serve serves at /


def model_config(exp: str) -> Path:
    """conf/model/<exp>.yaml: the model shape of an experiment."""
    return CONF_DIR / "model" / f"{exp}.yaml"


def experiments() -> list:
    """Names of the experiments conf/experiment/ defines, sorted."""
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
