"""ref/residual.py: the residual add pair against finite differences."""
import numpy as np

from andrea.backends import ref as K
from refkit import B, C, T, rnd, run_pair


def test_residual(rng=np.random.default_rng(7)):
    inp = {"a": rnd(rng, B, T, C), "b": rnd(rng, B, T, C)}
    run_pair(rng, K.k_residual_add,
             lambda g, R: K.k_residual_add_bwd(g["a"], g["b"], R),
             inp, (B, T, C), ["a", "b"])
