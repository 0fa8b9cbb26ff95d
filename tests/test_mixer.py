"""The data mixers (andrea/data/mixer.py) against docs/FIREHOSE-BANDIT.md."""
import json
import math

import numpy as np
import pytest

from andrea.data.mixer import Bandit, Mixer, make_mixer


def test_exp3_update_matches_hand_computed_values():
    K = 3
    b = Bandit(K, seed=5, reward="loss", alpha=0.5)
    # decision 1: eps_1 = min(1/3, sqrt(ln 3 / 3)) = 1/3, so p is uniform whatever w is
    g = b.pick()
    np.testing.assert_allclose(b.last_p, [1 / 3] * 3, rtol=0, atol=1e-15)
    b.update(1, 2.5)  # w = 0.5*0, then w_1 += 2.5/(1/3) = 7.5
    np.testing.assert_allclose(b.w, [0.0, 7.5, 0.0], atol=1e-12)
    # decision 2: sqrt(ln 3 / 6) = 0.4279 is clipped to 1/3: (1 - K eps) = 0, p stays uniform
    assert math.sqrt(math.log(3) / 6) > 1 / 3
    b.pick()
    np.testing.assert_allclose(b.last_p, [1 / 3] * 3, atol=1e-15)
    b.update(1, 2.0)  # w_1 = 0.5*7.5 + 2.0*3 = 9.75
    np.testing.assert_allclose(b.w, [0.0, 9.75, 0.0], atol=1e-12)
    b.pick(); b.update(0, 4.0)  # t=3: sqrt(ln3/9) = 0.3494 -> 1/3; w = [12, 4.875, 0]
    np.testing.assert_allclose(b.w, [12.0, 4.875, 0.0], atol=1e-12)
    # decision 4: eps_4 = sqrt(ln 3 / 12) = 0.302577 < 1/3; the exponent uses eps_prev = 1/3
    eps4 = math.sqrt(math.log(3) / 12)
    e = [math.exp(v / 3) for v in (12.0, 4.875, 0.0)]
    want = [(1 - 3 * eps4) * v / sum(e) + eps4 for v in e]
    b.pick()
    np.testing.assert_allclose(b.last_p, want, rtol=1e-12)
    assert sum(want) == pytest.approx(1.0) and b.eps_prev == pytest.approx(eps4)
    # the update divides by the probability the group was drawn with
    b.update(2, 3.0)
    w = [6.0, 2.4375, 3.0 / want[2]]
    np.testing.assert_allclose(b.w, w, rtol=1e-12)
    # decision 5 uses eps_prev = eps_4 in the exponent
    eps5 = math.sqrt(math.log(3) / 15)
    e = [math.exp(eps4 * v) for v in w]
    want5 = [(1 - 3 * eps5) * v / sum(e) + eps5 for v in e]
    b.pick()
    np.testing.assert_allclose(b.last_p, want5, rtol=1e-12)
    assert isinstance(g, int)


def test_draw_rule_is_min_index_with_u_below_running_sum():
    m = make_mixer("fixed", 3, seed=11, weights=[1, 2, 1])
    u = np.random.default_rng([11, 0x6D6978]).random(200)
    c = np.cumsum([0.25, 0.5, 0.25])
    want = [int(np.argmax(x < c)) for x in u]
    assert [m.pick() for _ in range(200)] == want


def test_deterministic_from_seed_and_seed_matters():
    def run(seed):
        b = make_mixer("bandit", 4, seed=seed, reward="loss")
        out = []
        for step in range(300):
            g = b.pick()
            out.append(g)
            b.update(g, 1.0 + g + 0.01 * (step % 7))
        return out, b.w.copy()

    a1, w1 = run(3)
    a2, w2 = run(3)
    a3, _ = run(4)
    assert a1 == a2 and np.array_equal(w1, w2)
    assert a1 != a3


def test_loss_reward_favours_high_loss_group():
    b = make_mixer("bandit", 3, seed=0, reward="loss")
    for _ in range(2000):
        g = b.pick()
        b.update(g, [1.0, 1.0, 5.0][g])
    assert b.probabilities()[2] > 0.6
    assert b.n[2] > b.n[0] + b.n[1]


def test_progress_reward_ignores_a_flat_group():
    rng = np.random.default_rng(9)
    b = make_mixer("bandit", 3, seed=1, reward="progress", reward_scale=10.0)
    visits = np.zeros(3, dtype=int)
    for _ in range(3000):
        g = b.pick()
        visits[g] += 1
        if g == 2:  # unlearnable: high, flat, noisy loss
            loss = 6.0 + 0.05 * rng.standard_normal()
        else:  # learnable: falls with its own visits
            loss = 1.0 + 4.0 * math.exp(-visits[g] / 400) + 0.05 * rng.standard_normal()
        b.update(g, loss)
    share = b.n / b.n.sum()
    assert share[2] < 1 / 3 - 0.05, share
    # the loss reward, on the same data, hands the flat high-loss group the most steps
    c = make_mixer("bandit", 3, seed=1, reward="loss")
    visits[:] = 0
    rng = np.random.default_rng(9)
    for _ in range(3000):
        g = c.pick()
        visits[g] += 1
        loss = (6.0 if g == 2 else 1.0 + 4.0 * math.exp(-visits[g] / 400)) + 0.05 * rng.standard_normal()
        c.update(g, loss)
    assert c.n[2] / c.n.sum() > 0.5


def test_progress_reward_first_visit_is_zero_and_smoothing():
    b = Bandit(2, seed=0, reward="progress", beta=0.5)
    b.pick(); b.update(0, 3.0)
    assert b.w[0] == 0.0 and b.s[0] == 3.0
    b.pick(); b.update(0, 2.0)  # s_old = 3, r = 1, s = 2.5; p = 1/2 while eps is 1/K
    assert b.s[0] == 2.5
    assert b.w[0] == pytest.approx(1.0 / 0.5)


@pytest.mark.parametrize("kind", ["uniform", "fixed", "bandit"])
def test_state_round_trip_through_json(kind):
    kw = {"weights": [3, 1, 0, 1]} if kind == "fixed" else {"reward": "progress"}
    a = make_mixer(kind, 4, seed=2, **kw)
    for i in range(57):
        g = a.pick()
        a.update(g, 2.0 + math.sin(i) if i != 20 else float("nan"))
    st = json.loads(json.dumps(a.state()))
    b = make_mixer(kind, 4, seed=2, **kw)
    b.load_state(st)
    for i in range(100):
        ga, gb = a.pick(), b.pick()
        assert ga == gb
        np.testing.assert_array_equal(a.last_p, b.last_p)
        a.update(ga, 1.0 / (i + 1)); b.update(gb, 1.0 / (i + 1))
    assert a.state() == b.state()


def test_load_state_refuses_another_mix():
    a = make_mixer("bandit", 3, seed=2, reward="loss")
    with pytest.raises(ValueError, match="mixer.reward"):
        make_mixer("bandit", 3, seed=2, reward="progress").load_state(a.state(), "x.json")
    with pytest.raises(ValueError, match="x.json: mixer.kind"):
        make_mixer("uniform", 3, seed=2).load_state(a.state(), "x.json")
    with pytest.raises(ValueError, match="mixer.names"):
        make_mixer("bandit", 3, seed=2, names=["a", "b", "c"]).load_state(a.state(), "x.json")


def test_baselines_sample_their_probabilities_and_never_learn():
    u = make_mixer("uniform", 4, seed=0)
    f = make_mixer("fixed", 4, seed=0, weights=[0, 1, 1, 2])
    for m in (u, f):
        for _ in range(4000):
            g = m.pick()
            m.update(g, 10.0 * g)
    np.testing.assert_allclose(u.last_p, [0.25] * 4)
    np.testing.assert_allclose(f.last_p, [0, 0.25, 0.25, 0.5])
    assert f.n[0] == 0
    np.testing.assert_allclose(u.n / 4000, [0.25] * 4, atol=0.03)
    np.testing.assert_allclose(f.n / 4000, [0, 0.25, 0.25, 0.5], atol=0.03)
    # same seed, same single draw per step: same u stream whatever the kind
    assert make_mixer("uniform", 4, seed=0).pick() == make_mixer("bandit", 4, seed=0).pick()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="kind='greedy'"):
        make_mixer("greedy", 2, 0)
    with pytest.raises(ValueError, match="needs 3 weights"):
        make_mixer("fixed", 3, 0, weights=[1, 2])
    with pytest.raises(ValueError, match="not all zero"):
        make_mixer("fixed", 2, 0, weights=[0, 0])
    with pytest.raises(ValueError, match="reward="):
        make_mixer("bandit", 2, 0, reward="gain")
    assert Mixer(1, 0).pick() == 0
