"""The data mixers: which group each optimizer step is drawn from (docs/FIREHOSE-BANDIT.md).

    mix = make_mixer("bandit", K=5, seed=1337, reward="progress")
    g = mix.pick()              # a group index; mix.last_p holds the probabilities it used
    ...train the step on group g...
    mix.update(g, loss)         # the step's training loss
    side["mixer"] = mix.state() # JSON-able; mix.load_state(side["mixer"]) restores it exactly

Three kinds: `uniform` and `fixed` (baselines, constant probabilities) and `bandit` (EXP3 / Gibbs
policy with decaying exploration, rewarded by the group's `loss` or its `progress`). NumPy only,
deterministic from the seed: one `rng.random()` per pick, whatever the kind or the rewards.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..config import MIXER_KINDS as KINDS, MIXER_REWARDS as REWARDS  # the config schema's allowed values
RNG_TAG = 0x6D6978  # "mix": the mixer's stream differs from the data order's and the weights'


class Mixer:
    """Constant probabilities p (the uniform and fixed baselines); the bandit subclasses it."""

    kind = "fixed"

    def __init__(self, K: int, seed: int, p: Optional[Sequence[float]] = None, beta: float = 0.9,
                 names: Sequence[str] = ()):
        if K < 1:
            raise ValueError(f"mixer: K={K} groups; expected at least one")
        self.K, self.seed, self.beta = int(K), int(seed), float(beta)
        self.names = list(names) or [str(i) for i in range(K)]
        if len(self.names) != K:
            raise ValueError(f"mixer: {len(self.names)} group names for K={K} groups")
        if p is None:
            self.kind = "uniform"
            p = np.full(K, 1.0 / K)
        self.p = _normalized(p, K)
        self.rng = np.random.default_rng([self.seed, RNG_TAG])
        self.t = 0
        self.n = np.zeros(K, dtype=np.int64)
        self.s = np.full(K, np.nan)  # smoothed training loss per group (nan: never drawn)
        self.last_p = self.p.copy()

    # ------------------------------------------------------------ decisions
    def probabilities(self) -> np.ndarray:
        """p_t of the next decision (does not advance anything)."""
        return self.p.copy()

    def _advance(self) -> np.ndarray:
        return self.p.copy()

    def pick(self) -> int:
        """Decide step t+1's group: compute p_t, draw one rng.random(), return the group index."""
        self.t += 1
        p = self._advance()
        self.last_p = p
        u = self.rng.random()
        c = np.cumsum(p)
        g = int(np.searchsorted(c, u, side="right"))  # min{i : u < c_i}
        return min(g, self.K - 1)

    def update(self, g: int, loss: float) -> None:
        """Feed back the training loss of a step drawn from group g (with probability last_p[g]).
        A non-finite loss (a skipped step) changes nothing."""
        if not 0 <= g < self.K:
            raise ValueError(f"mixer.update: group {g} out of range [0, {self.K})")
        loss = float(loss)
        if not math.isfinite(loss):
            return
        self.n[g] += 1
        s_old = self.s[g]
        self.s[g] = loss if np.isnan(s_old) else self.beta * s_old + (1.0 - self.beta) * loss
        self._learn(g, loss, s_old)

    def _learn(self, g, loss, s_old):
        pass

    # ------------------------------------------------------------ state
    def state(self) -> dict:
        return {"kind": self.kind, "K": self.K, "names": list(self.names), "seed": self.seed,
                "t": self.t, "n": self.n.tolist(), "s": _nullable(self.s), "p": self.p.tolist(),
                "last_p": self.last_p.tolist(), "rng": self.rng.bit_generator.state}

    def load_state(self, st: dict, source: str = "sidecar") -> None:
        for key, ours in (("kind", self.kind), ("K", self.K), ("names", list(self.names)),
                          ("seed", self.seed)):
            if st.get(key) != ours:
                raise ValueError(f"{source}: mixer.{key} is {st.get(key)!r} but this run's config gives "
                                 f"{ours!r}; the checkpoint belongs to another data mix")
        self.t = int(st["t"])
        self.n = np.asarray(st["n"], dtype=np.int64)
        self.s = np.array([np.nan if v is None else float(v) for v in st["s"]], dtype=np.float64)
        self.p = np.asarray(st["p"], dtype=np.float64)
        self.last_p = np.asarray(st["last_p"], dtype=np.float64)
        self.rng.bit_generator.state = st["rng"]

    def group_losses(self) -> list:
        return _nullable(self.s)


class Bandit(Mixer):
    """EXP3 weights with a Gibbs policy and decaying exploration (Online Data Mixing)."""

    kind = "bandit"

    def __init__(self, K: int, seed: int, reward: str = "loss", alpha: float = 0.99, beta: float = 0.9,
                 reward_scale: float = 1.0, names: Sequence[str] = ()):
        if reward not in REWARDS:
            raise ValueError(f"mixer: reward={reward!r}: expected one of {REWARDS}")
        super().__init__(K, seed, np.full(K, 1.0 / K), beta, names)
        self.kind = "bandit"
        self.reward, self.alpha, self.reward_scale = reward, float(alpha), float(reward_scale)
        self.w = np.zeros(K)
        self.eps_prev = 1.0 / K

    def eps(self, t: int) -> float:
        if self.K == 1:
            return 1.0
        return min(1.0 / self.K, math.sqrt(math.log(self.K) / (self.K * t)))

    def _gibbs(self, eps_t: float) -> np.ndarray:
        z = self.eps_prev * self.w
        e = np.exp(z - z.max())
        return (1.0 - self.K * eps_t) * e / e.sum() + eps_t

    def probabilities(self) -> np.ndarray:
        return self._gibbs(self.eps(self.t + 1))

    def _advance(self) -> np.ndarray:
        eps_t = self.eps(self.t)
        p = self._gibbs(eps_t)
        self.eps_prev = eps_t
        self.p = p
        return p.copy()

    def _learn(self, g, loss, s_old):
        if self.reward == "loss":
            r = loss
        else:
            r = 0.0 if np.isnan(s_old) else s_old - loss
        self.w *= self.alpha
        self.w[g] += self.reward_scale * r / self.last_p[g]

    def state(self) -> dict:
        st = super().state()
        st.update(reward=self.reward, alpha=self.alpha, beta=self.beta, reward_scale=self.reward_scale,
                  w=self.w.tolist(), eps_prev=self.eps_prev)
        return st

    def load_state(self, st: dict, source: str = "sidecar") -> None:
        if st.get("reward") != self.reward:
            raise ValueError(f"{source}: mixer.reward is {st.get('reward')!r} but this run's config "
                             f"gives {self.reward!r}")
        super().load_state(st, source)
        self.w = np.asarray(st["w"], dtype=np.float64)
        self.eps_prev = float(st["eps_prev"])


def make_mixer(kind: str, K: int, seed: int, weights: Sequence[float] = (), reward: str = "loss",
               alpha: float = 0.99, beta: float = 0.9, reward_scale: float = 1.0,
               names: Sequence[str] = ()) -> Mixer:
    """The mixer of a config's data.mixer settings."""
    if kind == "uniform":
        return Mixer(K, seed, None, beta, names)
    if kind == "fixed":
        if len(weights) != K:
            raise ValueError(f"mixer: kind=fixed needs {K} weights (one per group), got {len(weights)}")
        return Mixer(K, seed, weights, beta, names)
    if kind == "bandit":
        return Bandit(K, seed, reward, alpha, beta, reward_scale, names)
    raise ValueError(f"mixer: kind={kind!r}: expected one of {KINDS}")


def _normalized(p, K) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if p.shape != (K,) or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError(f"mixer: weights {p.tolist()}: expected {K} finite non-negative numbers, "
                         "not all zero")
    return p / p.sum()


def _nullable(a) -> list:
    return [None if np.isnan(v) else float(v) for v in a]
