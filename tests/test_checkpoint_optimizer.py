"""An optimizer's state saved with the weights and taken back (DiLoCo's inner AdamW, SAPO's policy optimizer): a
run resumed from its checkpoint takes the very step it would have taken without the restart."""

import pytest
import torch

from swarmd.protocols import checkpoint

pytestmark = pytest.mark.beside  # pure computation or virtual time (tests/conftest.py)


def model_and_opt(seed: int, cls=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_a_restored_optimizer_takes_the_same_next_step(tmp_path):
    model, opt = model_and_opt(0)
    for i in range(5):
        step(model, opt, i)
    tensors, meta = checkpoint.optimizer_entries(opt)
    weights = {"model." + k: v for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, {**weights, **tensors}, {"optimizer": meta})
    step(model, opt, 99)  # the run without a restart

    loaded, saved_meta = checkpoint.load(path)
    fresh, fresh_opt = model_and_opt(1)
    fresh.load_state_dict(checkpoint.model_state(loaded))
    checkpoint.restore_optimizer(fresh_opt, loaded, saved_meta["optimizer"])
    step(fresh, fresh_opt, 99)  # the restarted run
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    # a fresh optimizer instead (what a restart did before) takes another step
    other, other_opt = model_and_opt(1)
    other.load_state_dict(checkpoint.model_state(loaded))
    step(other, other_opt, 99)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_state_that_does_not_fit_is_refused_and_leaves_the_optimizer_as_it_was():
    model, opt = model_and_opt(0)
    step(model, opt, 0)
    tensors, meta = checkpoint.optimizer_entries(opt)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="saved for AdamW, not SGD"):
        checkpoint.restore_optimizer(sgd, tensors, meta)
    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    wider_opt = torch.optim.AdamW(wider.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="shape"):
        checkpoint.restore_optimizer(wider_opt, tensors, meta)
    assert wider_opt.state_dict()["state"] == {}
    with pytest.raises(ValueError):
        checkpoint.restore_optimizer(opt, {"optimizer.99.exp_avg": torch.zeros(3)}, meta)


def test_a_restored_optimizer_keeps_its_own_settings():
    # the moments come back; lr, betas and weight decay are the config's of the restarted node, not the saved ones
    model, opt = model_and_opt(0)
    for i in range(3):
        step(model, opt, i)
    tensors, meta = checkpoint.optimizer_entries(opt)
    torch.manual_seed(0)
    fresh = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.99), weight_decay=0.01)
    checkpoint.restore_optimizer(fresh, tensors, meta)
    group = fresh.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (5e-3, (0.9, 0.99), 0.01)
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
        assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        assert float(fresh.state[p]["step"]) == 3
    # grouped otherwise: refused, nothing loaded
    split = torch.optim.AdamW([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}])
    with pytest.raises(ValueError, match="groups"):
        checkpoint.restore_optimizer(split, tensors, meta)
    assert split.state_dict()["state"] == {}
