"""SwarmAdamW (protocols/inner.py): AdamW when alone, a data-parallel-sized step on noise when the swarm is M peers."""

import pytest
import torch

from swarmd.protocols.inner import SwarmAdamW, lr_scale

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def _run(opt_cls, grads, **kw):
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach().clone()


@pytest.mark.timeout(30)
def test_with_one_peer_it_is_torch_adamw():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, generator=gen) + 0.3 for _ in range(20)]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = _run(SwarmAdamW, grads, peers=1, **kw)
    ref = _run(torch.optim.AdamW, grads, **kw)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(30)
def test_with_m_peers_noise_steps_sqrt_m_larger_and_signal_steps_as_adamw():
    gen = torch.Generator().manual_seed(1)
    n, steps, m = 4096, 200, 4
    noise = [torch.randn(n, generator=gen) for _ in range(steps)]  # zero-mean: the noise-dominated coordinates
    signal = [torch.full((n,), 0.5) for _ in range(steps)]  # constant: signal-dominated
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)

    def last_step(grads, peers):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = SwarmAdamW([p], peers=peers, **kw)
        for g in grads[:-1]:
            p.grad = g.clone()
            opt.step()
        before = p.detach().clone()
        p.grad = grads[-1].clone()
        opt.step()
        return (p.detach() - before).abs().mean().item()

    ratio_noise = last_step(noise, m) / last_step(noise, 1)
    ratio_signal = last_step(signal, m) / last_step(signal, 1)
    assert 1.6 < ratio_noise < 2.2  # ~sqrt(4) = 2 (capped by the m^2 the finite window leaves)
    assert ratio_signal == pytest.approx(1.0, rel=1e-3)


@pytest.mark.timeout(30)
def test_set_peers_changes_the_step_and_bad_settings_are_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = SwarmAdamW([p])
    opt.set_peers(0)  # a round of nobody counts as one peer
    assert opt.param_groups[0]["peers"] == 1
    opt.set_peers(8)
    assert opt.param_groups[0]["peers"] == 8
    for bad in (dict(lr=0), dict(betas=(1.0, 0.9)), dict(eps=0), dict(weight_decay=-1), dict(peers=0)):
        with pytest.raises(ValueError):
            SwarmAdamW([torch.nn.Parameter(torch.zeros(1))], **bad)


@pytest.mark.timeout(30)
def test_the_step_is_the_documented_formula():
    """min(v/M + (1 - 1/M) m^2, v) on the bias-corrected moments, written out plainly here."""
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(256, generator=gen) * torch.linspace(0.1, 3, 256) + 0.4 for _ in range(12)]
    lr, (b1, b2), eps, wd, peers = 1e-2, (0.9, 0.95), 1e-8, 0.1, 3
    ours = _run(SwarmAdamW, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, peers=peers)
    p, m, v = (torch.zeros(256, dtype=torch.float64) for _ in range(3))
    for t, g in enumerate(grads, 1):
        g = g.double()
        p *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        second = torch.minimum(vh / peers + (1 - 1 / peers) * mh * mh, vh)
        p -= lr * mh / (second.sqrt() + eps)
    torch.testing.assert_close(ours, p.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
def test_the_lr_schedule_warms_up_linearly_then_follows_a_cosine_to_its_final_fraction():
    # warm-up: step i of w takes (i + 1) / w of the base, reaching it at the last warm-up step
    assert [lr_scale(i, 100, warmup=4) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_scale(4, 100, warmup=4) == pytest.approx(1.0)  # the cosine starts at the base
    assert lr_scale(52, 100, warmup=4, final=0.1) == pytest.approx(0.55)  # halfway: the mean of base and final
    assert lr_scale(100, 100, warmup=4, final=0.1) == pytest.approx(0.1)
    assert lr_scale(10_000, 100, warmup=4, final=0.1) == pytest.approx(0.1)  # past the end: stays at the final
    values = [lr_scale(i, 100, warmup=4, final=0.0) for i in range(3, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # never rises after the warm-up
    # an open-ended run (total 0): the warm-up, then the base for ever
    assert lr_scale(1, 0, warmup=4) == 0.5 and lr_scale(10**9, 0, warmup=4) == 1.0
    assert lr_scale(0, 0) == 1.0 == lr_scale(7, 0)  # no schedule at all


class _TinyLM(torch.nn.Module):
    """An embedding, two hidden matrices with a bias and a norm, a head: where Muon applies and where it does not."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 32, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.norm(self.down(torch.relu(self.up(self.embed(tokens))))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_the_hidden_matrices_adamw_the_rest_and_each_steps_as_its_torch_optimizer(tied):
    from swarmd.protocols import checkpoint
    from swarmd.protocols.inner import MuonAdamW, muon_for, muon_split

    torch.manual_seed(0)
    model, ref = _TinyLM(tied), _TinyLM(tied)
    ref.load_state_dict(model.state_dict())
    matrices, rest = muon_split(model)
    assert [id(p) for p in matrices] == [id(model.up.weight), id(model.down.weight)]
    assert {id(p) for p in rest} == {id(p) for p in model.parameters()} - {id(p) for p in matrices}
    opt = muon_for(model, lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1, peers=1)
    assert isinstance(opt, MuonAdamW) and [g["muon"] for g in opt.param_groups] == [True, False]
    m_ref, r_ref = muon_split(ref)
    refs = [torch.optim.Muon(m_ref, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(r_ref, lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1)]
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(4):
        tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step))
        for m, opts in ((model, [opt]), (ref, refs)):
            for o in opts:
                o.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(tokens).reshape(-1, 32), tokens.reshape(-1)).backward()
            for o in opts:
                o.step()
    for ours, theirs, before in zip(model.parameters(), ref.parameters(), start):
        assert not torch.equal(ours, before)  # every parameter stepped
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # its state goes through the loop's checkpoint and comes back into a fresh one
    tensors, meta = checkpoint.optimizer_entries(opt)
    fresh = muon_for(model, lr=2e-2, weight_decay=0.1)
    checkpoint.restore_optimizer(fresh, tensors, meta)
    assert torch.equal(fresh.state[model.up.weight]["momentum_buffer"], opt.state[model.up.weight]["momentum_buffer"])
    with pytest.raises(ValueError):
        MuonAdamW([model.up.bias], [])


@pytest.mark.timeout(60)
def test_the_loop_config_takes_muon_and_the_sparse_codec_settings():
    from pydantic import ValidationError

    from swarmd.protocols.diloco import DilocoConfig

    cfg = DilocoConfig(inner_optimizer="muon", codec="topk2", codec_options={"density": 1 / 32, "chunk": 1024},
                       feedback_decay=0.95)
    assert cfg.shared()["codec_options"] == {"density": 1 / 32, "chunk": 1024}
    assert "codec_options" not in DilocoConfig().shared()  # runs that never set it keep their fingerprint
    for bad in ({"codec": "topk2", "codec_options": {"chunk": 1000}}, {"codec_options": {"nonsense": 1}},
                {"codec": "nope"}, {"feedback_decay": 0}, {"inner_optimizer": "sgd"}):
        with pytest.raises(ValidationError):
            DilocoConfig(**bad)
