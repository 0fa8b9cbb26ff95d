"""Kept until the CUDA backend's imports move: the old names, now in ref/ and interface.py."""
from .ref import *  # noqa: F401,F403
from .ref import _act, _dgelu, _gelu, _gelu_grad, _linear_bwd, _linear_fwd  # noqa: F401
