"""Find what a trained model is made of from one path: its config, checkpoint and tokenizer.

    m = locate("results/ANDREA-tiny")            # a run folder
    m = locate("results/ANDREA-tiny/archive/final")   # an archive (self-contained)
    m = locate("results/ANDREA-tiny/checkpoints/step_00001500.bin")   # one checkpoint
    cfg, params = m.load()

A run folder resolves to its `archive/final` when there is one, else to the newest valid
checkpoint of its `checkpoints/`. The config is `config.yaml` beside the checkpoint (an archive)
or in the run folder; the tokenizer is `tokenizer.json` beside the checkpoint when archived, else
the config's data.tokenizer. Every failure names the path and what was expected there.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class LocateError(ValueError):
    """A path that does not lead to a usable model."""


@dataclass
class Located:
    config: Path
    checkpoint: Path
    tokenizer: Optional[Path]  # None: the config's data.tokenizer

    def load(self):
        """(AndreaConfig, float32 flat weights), the checkpoint checked against the config."""
        from ..core.checkpoint import CheckpointError, read_checkpoint
        from ..config import config_hash, load_run_config
        from ..core.model import count_params

        try:
            cfg = load_run_config(self.config)
        except Exception as e:  # OmegaConf, YAML and validation errors all mean "bad config"
            raise LocateError(f"config {self.config}: {e}") from None
        try:
            ck = read_checkpoint(self.checkpoint, count_params(cfg.model), config_hash(cfg))
        except CheckpointError as e:
            raise LocateError(str(e)) from None
        return cfg, ck.params

    def tokenizer_path(self, cfg) -> Path:
        return self.tokenizer if self.tokenizer is not None else Path(cfg.data.tokenizer)


def _newest_in(d: Path) -> Optional[Path]:
    from ..core.checkpoint import is_valid, list_checkpoints

    for p in reversed(list_checkpoints(d)):
        if is_valid(p):
            return p
    return None


def locate(path, tokenizer=None) -> Located:
    path = Path(path)
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
        ckpt = _newest_in(folder)
        if ckpt is None and (path / "checkpoints").is_dir():
            folder = path / "checkpoints"
            ckpt = _newest_in(folder)
        if ckpt is None:
            raise LocateError(f"{path}: no valid checkpoint (step_XXXXXXXX.bin with a matching .json sidecar) "
                              f"in {path}, {path / 'archive' / 'final'} or {path / 'checkpoints'}")
        config = next((c for c in (folder / "config.yaml", folder.parent / "config.yaml") if c.is_file()), None)
        if config is None:
            raise LocateError(f"{path}: no config.yaml in {folder} or {folder.parent}")
    tok = Path(tokenizer) if tokenizer else (folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None)
    return Located(config, ckpt, tok)


def load_tokenizer_for(located: Located, cfg):
    """The run's tokenizer, or a LocateError naming where it was looked for."""
    from ..data.tokenizer import TokenizerError, load_tokenizer

    path = located.tokenizer_path(cfg)
    try:
        tok = load_tokenizer(path)
    except TokenizerError as e:
        raise LocateError(f"{e} (pass --tokenizer, or archive the run: archive/final holds its tokenizer)") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise LocateError(f"tokenizer {path}: {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size} "
                          f"in {located.config}; not this model's tokenizer")
    return tok
