"""Find what a trained model is made of from one path: its config, checkpoint and tokenizer.

    m = locate("results/ANDREA-tiny")            # a run folder
    m = locate("results/ANDREA-tiny/archive/final")   # an archive (self-contained)
    m = locate("results/ANDREA-tiny/checkpoints/step_00001500.bin")   # one checkpoint
    cfg, params = m.load()

A run folder resolves to its `archive/final` when there is one, else to the newest valid
checkpoint of its `checkpoints/`; each newer checkpoint passed over is named on stderr with
the reason it is not valid (core/checkpoint.why_invalid, as training reports it). The config is
`config.yaml` beside the checkpoint (an archive) or in the run folder; the tokenizer is
`tokenizer.json` beside the checkpoint when archived, else the config's data.tokenizer
(--tokenizer: a tokenizer.json or a folder holding one). Every failure is one line naming the
path and what was expected there (load_config: a bad config file).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple


class LocateError(ValueError):
    """A path that does not lead to a usable model."""


@dataclass
class Located:
    config: Path
    checkpoint: Path
    tokenizer: Optional[Path]  # None: the config's data.tokenizer
    skipped: List[Tuple[Path, str]] = field(default_factory=list)  # newer checkpoints not valid, why

    def load(self):
        """(AndreaConfig, float32 flat weights), the checkpoint checked against the config."""
        from ..core.checkpoint import CheckpointError, read_checkpoint
        from ..config import config_hash
        from ..core.model import count_params

        cfg = load_config(self.config)
        try:
            ck = read_checkpoint(self.checkpoint, count_params(cfg.model), config_hash(cfg))
        except CheckpointError as e:
            raise LocateError(str(e)) from None
        return cfg, ck.params

    def tokenizer_path(self, cfg) -> Path:
        return self.tokenizer if self.tokenizer is not None else Path(cfg.data.tokenizer)


CONFIG_EXPECTED = "expected a run's resolved config (a YAML mapping of exp, model, data, train, ...)"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_config(path):
    """The AndreaConfig of a config file, or a LocateError of one line naming the file and what is
    wrong with it (not YAML, not text, a field that is not ANDREA's or of the wrong type, a value out
    of range)."""
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    from ..config import load_run_config

    path = Path(path)
    if path.is_dir():
        raise LocateError(f"config {path}: a folder; {CONFIG_EXPECTED} file")
    if not path.is_file():
        raise LocateError(f"config {path}: no such file; {CONFIG_EXPECTED}")
    try:
        if not path.read_bytes().strip():
            raise LocateError(f"config {path}: empty; {CONFIG_EXPECTED}")
        return load_run_config(path)
    except LocateError:
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise LocateError(f"config {path}: not valid YAML{at} ({_one_line(e.problem or e.context or e)}); "
                          f"{CONFIG_EXPECTED}") from None
    except yaml.YAMLError as e:
        raise LocateError(f"config {path}: not valid YAML ({_one_line(e)}); {CONFIG_EXPECTED}") from None
    except UnicodeDecodeError as e:
        raise LocateError(f"config {path}: not a UTF-8 text file (byte {e.start}); {CONFIG_EXPECTED}") from None
    except OmegaConfBaseException as e:
        first = _one_line(str(e).splitlines()[0] if str(e) else type(e).__name__)
        key = getattr(e, "full_key", None)
        raise LocateError(f"config {path}: {first}{f' (field {key})' if key else ''}; {CONFIG_EXPECTED}") from None
    except OSError as e:
        raise LocateError(f"config {path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # validate(): already names the file, the field and what was expected
        raise LocateError(_one_line(e)) from None


def _newest_in(d: Path, skipped: List[Tuple[Path, str]]) -> Optional[Path]:
    """The newest valid checkpoint of d; each newer one that is not valid is added to skipped with
    the reason (core/checkpoint.why_invalid, as training reports it)."""
    from ..core.checkpoint import list_checkpoints, why_invalid

    for p in reversed(list_checkpoints(d)):
        reason = why_invalid(p)
        if reason is None:
            return p
        skipped.append((p, reason))
    return None


def report_skipped(located: "Located", prog: str = "andrea", file=None) -> None:
    """One line on stderr per checkpoint passed over for being damaged or incomplete."""
    for p, reason in located.skipped:
        print(f"{prog}: skipping checkpoint {p}: {reason}; using {located.checkpoint}",
              file=file or sys.stderr, flush=True)


def locate(path, tokenizer=None, prog: Optional[str] = "andrea") -> Located:
    """Where the model of path is; a damaged checkpoint passed over is named on stderr with its
    reason (prefixed with prog; None: not printed, see Located.skipped)."""
    located = _locate(Path(path), tokenizer)
    if prog:
        report_skipped(located, prog)
    return located


def tokenizer_file(tokenizer) -> Path:
    """--tokenizer: a tokenizer.json file, or a folder holding one (an export, an archive)."""
    t = Path(tokenizer)
    if t.is_dir():
        if (t / "tokenizer.json").is_file():
            return t / "tokenizer.json"
        raise LocateError(f"--tokenizer {t}: a folder without tokenizer.json in it; expected a tokenizer.json "
                          "file or a folder holding one")
    if not t.exists():
        raise LocateError(f"--tokenizer {t}: no such file; expected a tokenizer.json file or a folder holding one")
    return t


def _locate(path: Path, tokenizer=None) -> Located:
    skipped: List[Tuple[Path, str]] = []
    if not path.exists():
        raise LocateError(f"{path}: no such file or folder; expected a run folder (results/<exp>), "
                          "an archive folder (results/<exp>/archive/final) or a step_XXXXXXXX.bin checkpoint")
    if path.is_file():
        if path.suffix != ".bin":
            raise LocateError(f"{path}: expected a step_XXXXXXXX.bin checkpoint, a run folder or an archive folder")
        ckpt, folder = path, path.parent
        config = next((c for c in (folder / "config.yaml", folder.parent / "config.yaml") if c.is_file()), None)
        if config is None:
            raise LocateError(f"{path}: no config.yaml beside it or in {folder.parent}; "
                              "expected the run folder layout results/<exp>/checkpoints/step_XXXXXXXX.bin")
    else:
        folder = path
        if (path / "archive" / "final").is_dir():
            folder = path / "archive" / "final"
        ckpt = _newest_in(folder, skipped)
        if ckpt is None and (path / "checkpoints").is_dir():
            folder = path / "checkpoints"
            ckpt = _newest_in(folder, skipped)
        if ckpt is None:
            bad = ("; " + f"{len(skipped)} checkpoint(s) and none is valid: "
                   + ", ".join(f"{p} ({r})" for p, r in skipped)) if skipped else ""
            raise LocateError(f"{path}: no valid checkpoint (step_XXXXXXXX.bin with a matching .json sidecar) "
                              f"in {path}, {path / 'archive' / 'final'} or {path / 'checkpoints'}{bad}")
        config = next((c for c in (folder / "config.yaml", folder.parent / "config.yaml") if c.is_file()), None)
        if config is None:
            raise LocateError(f"{path}: no config.yaml in {folder} or {folder.parent}")
    tok = tokenizer_file(tokenizer) if tokenizer else (folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None)
    return Located(config, ckpt, tok, skipped)


def load_tokenizer_for(located: Located, cfg):
    """The run's tokenizer, or a LocateError naming where it was looked for."""
    from ..data.tokenizer import TokenizerError, load_tokenizer

    path = located.tokenizer_path(cfg)
    if path.is_dir():
        raise LocateError(f"tokenizer {path} (data.tokenizer of {located.config}): a folder; expected a "
                          "tokenizer.json file (pass --tokenizer)")
    try:
        tok = load_tokenizer(path)
    except TokenizerError as e:
        raise LocateError(_one_line(f"{e} (pass --tokenizer, or archive the run: archive/final holds its "
                                    "tokenizer)")) from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise LocateError(f"tokenizer {path}: {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size} "
                          f"in {located.config}; not this model's tokenizer")
    return tok
