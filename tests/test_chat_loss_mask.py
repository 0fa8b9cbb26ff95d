"""The chat loss mask (train.phases[].loss_on=assistant): the answer mask from the chat template's
roles (andrea/data/chat.py), the loader's (x, y, keep) batches with the turn a window starts in
read from its shard, the config field, and the engine's step: the targets outside the answers
ignored and the gradient torch's cross_entropy(ignore_index=-1, mean) over the whole step's batch,
whatever its microbatches; a loss_on=all step the same bits as a run without the field."""
import re

import numpy as np
import pytest

from andrea.config import config_hash, load_run_config
from andrea.core.engine import Engine
from andrea.data.chat import (IGNORE_INDEX, SPECIAL_IDS, SPECIAL_TOKENS, answer_mask, render_conversation)
from andrea.data.loader import ShardLoader
from andrea.data.shards import write_shard

CONV = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi there"},
        {"from": "gpt", "value": "hello"}, {"from": "tool", "value": "t"},
        {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4 ok"}]


def char_tokens(text):
    """A stand-in tokenizer: each special token its reserved id, any other character 6 + its
    code modulo 50; and which tokens are an answer's text or its closing <|end|>, read from the text."""
    ids, answer, role = [], [], None
    for piece in re.split("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")", text):
        if piece in SPECIAL_IDS:
            ids.append(SPECIAL_IDS[piece])
            answer.append(piece == "<|end|>" and role == "<|assistant|>")
            role = None if piece in ("<|end|>", "<|endoftext|>") else piece
        else:
            ids += [6 + ord(ch) % 50 for ch in piece]
            answer += [role == "<|assistant|>"] * len(piece)
    return np.array(ids, np.int32), np.array(answer)


def test_answer_mask_marks_the_assistant_turns_of_the_template():
    toks, want = char_tokens(render_conversation(CONV) * 3)
    np.testing.assert_array_equal(answer_mask(toks), want)
    assert want.sum() == 3 * (len("hello") + len("4 ok") + 2)  # the answers and their two <|end|>
    for cut in range(1, len(toks) - 1):  # a slice knows its first turn from the special before it
        specials = np.flatnonzero(toks[:cut] < len(SPECIAL_TOKENS))
        before = int(toks[specials[-1]]) if specials.size else -1
        np.testing.assert_array_equal(answer_mask(toks[cut:], before), want[cut:])


def stream_shards(tmp_path, n_conv=40):
    toks, want = char_tokens(render_conversation(CONV) * n_conv)
    half = len(toks) // 2 + 7  # a shard boundary in the middle of a conversation
    write_shard(tmp_path / "train_000.bin", toks[:half])
    write_shard(tmp_path / "train_001.bin", toks[half:])
    return toks, want, half


def test_loader_answers_follow_the_shards(tmp_path):
    """keep of every window is the answer mask of its shard's stream at the window's targets (the
    second shard starts mid-conversation: its first turn is unknown, so not counted); x and y and
    the loader's state are those of a loader without answers."""
    toks, want, half = stream_shards(tmp_path)
    B, T = 3, 23
    plain = ShardLoader(str(tmp_path / "train_*.bin"), B, T, seed=5, vocab_size=64)
    masked = ShardLoader(str(tmp_path / "train_*.bin"), B, T, seed=5, vocab_size=64, answers=True)
    own = [answer_mask(toks[:half]), answer_mask(toks[half:])]
    for _ in range(2 * plain.n_windows // B):
        x, y = plain.next_batch()
        x2, y2, keep = masked.next_batch()
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
        for b in range(B):
            k = int(masked._order[(masked.cursor - B + b) % masked.n_windows]) if masked.cursor >= B else None
            if k is None:
                continue
            s, off = masked._where(k)
            np.testing.assert_array_equal(keep[b], own[s][off + 1:off + T + 1])
    assert masked.state() == plain.state()
    assert 0.2 < want.mean() < 0.6


def tiny_cfg(tmp_path, phases, grad_accum=2):
    stream_shards(tmp_path)
    write_shard(tmp_path / "val_000.bin", np.arange(200) % 60)
    return load_run_config({"model": {"n_layer": 1, "d_model": 16, "n_head": 2, "context": 16, "vocab_size": 64},
                            "train": {"batch_size": 2, "seq_len": 13, "grad_accum": grad_accum, "steps": 6,
                                      "warmup_steps": 1, "init_std": 0.3, "phases": phases},
                            "data": {"train_shards": str(tmp_path / "train_*.bin"),
                                     "val_shards": str(tmp_path / "val_*.bin")},
                            "backend": {"name": "numpy"}})


def torch_mean_loss(cfg, views, tokens, targets):
    """The model in PyTorch (float64) with cross_entropy(ignore_index=-1) over tokens (N, T)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    P = {k: torch.tensor(np.array(v), dtype=torch.float64, requires_grad=True) for k, v in views.items()}
    B, T = tokens.shape
    C, NH = cfg.model.d_model, cfg.model.n_head
    x = P["wte"][torch.tensor(tokens, dtype=torch.long)] + P["wpe"][:T]
    for l in range(cfg.model.n_layer):
        w = {k.split(".", 1)[1]: v for k, v in P.items() if k.startswith(f"h{l}.")}
        h = F.layer_norm(x, (C,), w["ln1_w"], w["ln1_b"], eps=1e-5)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in F.linear(h, w["qkv_w"], w["qkv_b"]).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, w["attn_out_w"], w["attn_out_b"])
        h = F.gelu(F.linear(F.layer_norm(x, (C,), w["ln2_w"], w["ln2_b"], eps=1e-5), w["mlp_w1"], w["mlp_b1"]),
                   approximate="tanh")
        x = x + F.linear(h, w["mlp_w2"], w["mlp_b2"])
    logits = F.layer_norm(x, (C,), P["lnf_w"], P["lnf_b"], eps=1e-5) @ P["wte"].T
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(targets, dtype=torch.long).reshape(-1),
                           ignore_index=IGNORE_INDEX)
    loss.backward()
    return float(loss.detach()), {k: t.grad.numpy() for k, t in P.items()}


def test_assistant_step_is_torchs_ignore_index_mean_over_the_step(tmp_path):
    """One loss_on=assistant step of two microbatches whose answers differ in number: the averaged
    gradient (the grads buffer over the microbatches, as the optimizer takes it) and the recorded
    loss are torch's cross_entropy(ignore_index=-1, reduction mean) over both microbatches at once."""
    cfg = tiny_cfg(tmp_path, [{"name": "polish", "start_step": 0, "loss_on": "assistant"}])
    eng = Engine(cfg, dtype="float64")
    views = {k: np.array(v) for k, v in eng.layout.views(eng.be.to_numpy(eng.params).copy()).items()}
    loader = ShardLoader(cfg.data.train_shards, 2, 13, seed=1, vocab_size=64, answers=True)
    batches = loader.next_step(2)
    counts = [int(b[2].sum()) for b in batches]
    assert counts[0] != counts[1] and min(counts) > 0, counts
    rec = eng.train_step(1, batches)
    tokens = np.concatenate([b[0] for b in batches])
    targets = np.concatenate([np.where(b[2], b[1], IGNORE_INDEX) for b in batches])
    loss, grads = torch_mean_loss(cfg, views, tokens, targets)
    assert abs(rec["loss"] - loss) / loss < 1e-9, (rec["loss"], loss)
    ours = eng.layout.views(eng.be.to_numpy(eng.grads) / 2)  # the step's average over its 2 microbatches
    # the loss gradient is the engine's float32 dloss (1 / (B*T), then times the step's factor):
    # two float32 roundings, each within 2^-24 relative, scale every gradient alike
    for name, g in grads.items():
        assert np.linalg.norm(ours[name] - g) / np.linalg.norm(g) < 2.5 * 2.0 ** -24, name


def test_loss_on_all_steps_keep_their_bits(tmp_path):
    """Before an assistant phase starts its steps are those of a run without phases, bit for bit
    (weights after 3 steps), though the loader then carries the answer mask; an explicit
    loss_on=all hashes as a run without the field."""
    runs = {}
    for name, phases in (("none", []), ("later", [{"name": "polish", "start_step": 3, "loss_on": "assistant"}])):
        cfg = tiny_cfg(tmp_path, phases)
        from andrea.data.loader import train_loader
        eng, loader = Engine(cfg), train_loader(cfg)
        for step in range(1, 4):
            eng.train_step(step, loader.next_step(2))
        runs[name] = eng.be.to_numpy(eng.params).tobytes()
    assert runs["none"] == runs["later"]
    plain = tiny_cfg(tmp_path, [{"name": "polish", "start_step": 2}])
    explicit = tiny_cfg(tmp_path, [{"name": "polish", "start_step": 2, "loss_on": "all"}])
    assistant = tiny_cfg(tmp_path, [{"name": "polish", "start_step": 2, "loss_on": "assistant"}])
    assert config_hash(plain) == config_hash(explicit) != config_hash(assistant)


def test_loss_on_refuses_other_values(tmp_path):
    with pytest.raises(ValueError, match=r"train.phases\[0\].loss_on='answers': expected one of all, assistant"):
        tiny_cfg(tmp_path, [{"name": "polish", "start_step": 2, "loss_on": "answers"}])


def test_chat_experiments_polish_on_the_answers():
    """ANDREA-12M and ANDREA-120M train their last tenth on the assistant's tokens; the synthetic
    experiments count every target (their published losses stand)."""
    from andrea.train import compose_config
    for exp in ("ANDREA-12M", "ANDREA-120M"):
        t = compose_config(exp).train
        assert [(p.name, p.loss_on) for p in t.phases] == [("pretrain", "all"), ("polish", "assistant")]
        assert t.phases[1].start_step == t.steps * 9 // 10
    for exp in ("ANDREA-12M-synthetic", "ANDREA-120M-synthetic", "ANDREA-tiny"):
        assert all(p.loss_on == "all" for p in compose_config(exp).train.phases)


def test_resumed_assistant_phase_keeps_the_bits(tmp_path):
    """Six loss_on=assistant steps straight, or three, then a new engine and loader from the first's
    state (as a checkpoint resumes), then three: the same weights and Adam state, bit for bit."""
    from andrea.data.loader import train_loader
    cfg = tiny_cfg(tmp_path, [{"name": "pretrain", "start_step": 0}, {"name": "polish", "start_step": 2,
                                                                        "loss_on": "assistant"}])
    straight, loader = Engine(cfg), train_loader(cfg)
    for s in range(1, 7):
        straight.train_step(s, loader.next_step(2))
    first, loader = Engine(cfg), train_loader(cfg)
    for s in range(1, 4):
        first.train_step(s, loader.next_step(2))
    resumed, again = Engine(cfg), train_loader(cfg)
    resumed.load_state(first.state())
    again.load_state(loader.state())
    for s in range(4, 7):
        resumed.train_step(s, again.next_step(2))
    for a, b in zip(straight.host_state(), resumed.host_state()):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
