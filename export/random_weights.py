"""Random, non-trivial parameters in the `laplace_jax.spec.PARAMS` tree (numpy float32): the weights
of serving benchmarks and of export/vLLM checks that need no trained checkpoint."""
import numpy as np

from laplace_jax import spec
from laplace_jax.spec import Arch


def _scale(p: spec.Param, arch: Arch) -> tuple[float, float]:
    """(mean, std) of one weight kind: norms near 1, matrices at unit gain, the rest O(1) so that
    every term of the math matters (all-zero aug_balance would hide a wrong self-augmentation)."""
    if p.init == "ones":
        return 1.0, 0.1
    if p.to_torch == "t":                       # a matrix [in, out]: unit gain from fan-in
        fan_in = p.shape(arch)[-2]
        # the head's logits spread ~3 nats so greedy picks are far apart from rounding
        return 0.0, fan_in ** -0.5 * (3.0 if p.name == "lm_head" else 1.0)
    return 0.0, (1.0 if p.name == "embed" else 0.5)


def random_params(arch: Arch, seed: int = 0) -> dict:
    """{name: array, "layers": {name: [L, ...] array}} with shapes from the spec."""
    r = np.random.default_rng(seed)

    def draw(p: spec.Param) -> np.ndarray:
        mean, std = _scale(p, arch)
        # drawn in float32: the 3B's 3.1e9 values take a quarter of float64's time on numpy's one thread
        x = r.standard_normal(p.shape(arch), dtype=np.float32)
        x *= np.float32(std)
        x += np.float32(mean)
        return x

    tree = {p.name: draw(p) for p in spec.global_params()}
    tree["layers"] = {p.name: draw(p) for p in spec.layer_params()}
    return tree
