"""The sub-network scheduler part: levels from the windows and the simulator, a round at two widths equals the hand
count-mean merge, the Fisher window by hand, the checks, and composition with FedProx and DRFA's lambda sampling."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_fed, raises_one_line, run_rounds
from torch import nn

from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.models.scalable import ScalableCNN, StaticBatchNorm2d, rebuild_bn_stats
from flx.models.width import masks_from_indices, width_masks
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.parts.systems import whale_utility as wu
from flx.parts.systems.subnetwork import MAX_LEVELS, Subnetwork
from flx.systems.simulator import LatencySimulator

SYSTEM = dict(
    types=list(MAX_LEVELS),
    num_devices=20,
    profile="cnn_mnist",
    link_rates_mbps=[80, 20, 10],
    upload_bits=12352000,
    dynamics="markov",
    switch_prob=0.1,
    load_min=0.5,
    trace_seed=0,
)
CFG = dict(local_steps=2, batch_size=8, lr=0.05, aggregator="count_mean", weighting="uniform", seed=3)


def cnn(seed: int = 0, norm: str = "bn") -> ScalableCNN:
    torch.manual_seed(seed)
    return ScalableCNN(input_shape=(1, 8, 8), num_classes=3, widths=[4, 4, 8, 8], norm=norm).double()


def store(sizes: list[int], seed: int = 0) -> ClientStore:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x, y = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    return ClientStore(x, y, [torch.arange(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])])


def fed_with(parts: list, data: ClientStore, net: nn.Module | None = None, **kw: object):
    cfg = {**CFG, "clients_per_round": len(data.client_indices), **kw}
    return make_fed(net if net is not None else cnn(), data, parts=parts, system=simulator(cfg), **cfg)


def simulator(cfg: dict) -> LatencySimulator:
    return LatencySimulator(batch_size=cfg["batch_size"], local_steps=cfg["local_steps"], **SYSTEM)


def test_fixed_levels_are_the_device_caps() -> None:
    """scheduler=fixed: client i on device type types[i mod 5] trains level p_max (HeteroFL's fixed assignment)."""
    part = Subnetwork(scheduler="fixed")
    fed = fed_with([part], store([6] * 5))
    run_rounds(fed, 1)
    assert part.levels == {i: i + 1 for i in range(5)}
    assert [fed.rnd.width(i) for i in range(5)] == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_whale_levels_cold_start_then_the_utility() -> None:
    """Round 0: empty windows -> level P for all; round 1: p = max(quantise(min(TE SE^beta / U_th, 1)), p_max) with TE
    from the window (|B| = ceil(n_i / B)) and SE from the smallest width's simulated times, computed here by hand."""
    part = Subnetwork(u_th=2000.0, T=2.0, beta=2.0, fisher_samples=None)
    fed = fed_with([part], store([9, 17, 6, 12, 8]))
    run_rounds(fed, 1)
    assert set(part.levels.values()) == {5}
    run_rounds(fed, 1, start=1)
    for cid in range(5):
        t_co, t_tr = fed.system.unit_times(cid, 1, steps=2)
        te = -(-fed.num_samples(cid) // 8) * part.windows[cid][0] ** 0.5  # the window at round 1's start: round 0
        util = te * (2.0 / (t_co + t_tr)) ** 2
        assert part.levels[cid] == max(wu.quantise(min(util / 2000.0, 1.0), 5), MAX_LEVELS[SYSTEM["types"][cid]])


def test_the_window_holds_the_mean_fi_squared_by_hand() -> None:
    """One client, full width (a MacBook: p_max 1, fixed), K = 2 full-batch steps: the window gets
    (FI_0^2 + FI_1^2) / 2 with FI_k the per-sample trace at the k-th step's weights, replayed by hand."""
    data = store([7])
    part = Subnetwork(scheduler="fixed", fisher_samples=None, track_fisher=True)  # fixed tracks it only on request
    fed = fed_with([part], data, lr=0.1)
    ref = copy.deepcopy(fed.net)
    run_rounds(fed, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    fis = []
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(ref(data.x), data.y).backward()
        fis.append(float(wu.batch_fisher_tensor(ref, F.cross_entropy, data.x, data.y, None)))
        opt.step()
    assert part.windows[0] == pytest.approx([(fis[0] ** 2 + fis[1] ** 2) / 2], rel=1e-9)
    for a, b in zip(fed.net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_history_counts_rounds_as_fl_round_and_the_fisher_trace_has_a_line_per_client() -> None:
    """Two rounds of 5 clients: the history's rounds are 1 and 2 (``fl/round``: rounds done, after the round); the
    Fisher trace is one line per client, ``(clock, sqrt(mean FI^2))`` of each round it trained in. A checkpoint
    written before the rounds were 1-based (no ``round_base``: rounds 0 and 1) loads as rounds 1 and 2."""
    part = Subnetwork(track_fisher=True)
    fed = fed_with([part], store([6] * 5))
    run_rounds(fed, 2)
    assert [h["round"] for h in part.history] == [1, 2] == [fed.server.round - 1, fed.server.round]
    clocks = [h["clock"] for h in part.history]
    trace = part.fisher_trace()
    assert list(trace) == [f"client {c}" for c in range(5)]
    for c in range(5):
        assert trace[f"client {c}"] == [(clocks[r], part.history[r]["fi"][c]) for r in range(2)]
        assert part.windows[c] == pytest.approx([v**2 for _, v in trace[f"client {c}"]], rel=1e-12)
    state = part.state_dict()
    again = Subnetwork()
    again.load_state_dict(copy.deepcopy(state))
    assert again.history == part.history
    old = copy.deepcopy(state)
    del old["round_base"]
    for h in old["history"]:
        h["round"] -= 1  # as flx wrote it before: 0-based
    again.load_state_dict(old)
    assert again.history == part.history


def test_two_clients_at_two_widths_equal_the_hand_merge() -> None:
    """Clients 0 (width 1) and 1 (width 1/2, prefix), one full-batch step each, norm=none: client i's model is
    w - eta m_i * grad f_i(m_i * w) at its Scaler width; each entry is the mean over the clients that hold it."""
    data = store([5, 6])
    part = Subnetwork(scheduler="fixed")
    net = cnn(norm="none")
    fed = fed_with([part], data, net=net, local_steps=1, lr=0.1)
    w0 = [p.detach().clone() for p in net.parameters()]
    uploads, masks = [], []
    for cid, rho in ((0, 1.0), (1, 0.5)):
        ref = copy.deepcopy(net)
        m = width_masks(ref, rho, "prefix")
        with torch.no_grad():
            for p, mk, w in zip(ref.parameters(), m, w0):
                p.copy_(w * mk)
        ref.set_width(rho)
        rows = data.client_indices[cid]
        F.cross_entropy(ref(data.x[rows]), data.y[rows]).backward()
        uploads.append([(p - 0.1 * p.grad * mk).detach() for p, mk in zip(ref.parameters(), m)])
        masks.append(m)
    run_rounds(fed, 1)
    for j, (p, w) in enumerate(zip(net.parameters(), w0)):
        s = uploads[0][j] * masks[0][j] + uploads[1][j] * masks[1][j]
        c = masks[0][j] + masks[1][j]
        torch.testing.assert_close(p.detach(), torch.where(c > 0, s / c.clamp_min(1), w), rtol=0, atol=1e-12)


def test_the_random_extractor_is_seeded_by_round_and_client() -> None:
    a, b = (fed_with([Subnetwork(scheduler="fixed", extractor="random")], store([6] * 5)) for _ in range(2))
    run_rounds(a, 2)
    run_rounds(b, 2)
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"aggregator": "mean"}, "algo.aggregator"), ({"system": None}, "system=none"), ({"net": "linear"}, "model=")],
)
def test_requirements_fail_with_one_line(kw: dict, match: str) -> None:
    data = store([6, 6])
    with pytest.raises(ConfigError, match=match) as info:
        if "system" in kw:
            make_fed(cnn(), data, parts=[Subnetwork()], **{**CFG, "clients_per_round": 2})
        elif "net" in kw:
            flat = ClientStore(data.x.flatten(1), data.y, data.client_indices)
            fed_with([Subnetwork()], flat, net=nn.Linear(64, 3).double())
        else:
            fed_with([Subnetwork()], data, **kw)
    assert "\n" not in str(info.value)


def test_bad_options_rejected() -> None:
    with pytest.raises(ConfigError, match="algo.scheduler"):
        Subnetwork(scheduler="greedy")
    with pytest.raises(ConfigError, match="algo.max_levels"):
        Subnetwork(max_levels={"Nano": 9})


def test_on_top_of_fedprox_the_prox_term_is_masked_too() -> None:
    """Prox listed first, then the scheduler: masked-out entries stay exactly zero during local training (the prox
    term -mu w^t there is masked), so mu = 0 equals plain WHALE and mu > 0 changes only the sub-models' entries."""
    data = store([6, 7, 8, 5, 9])
    plain = fed_with([Subnetwork()], data)
    prox0 = fed_with([Prox(0.0), Subnetwork()], data)
    prox = fed_with([Prox(0.5), Subnetwork()], data)
    for fed in (plain, prox0, prox):
        run_rounds(fed, 3)
    for a, b in zip(plain.net.parameters(), prox0.net.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(plain.net.parameters(), prox.net.parameters()))
    assert all(torch.isfinite(p).all() for p in prox.net.parameters())


def test_with_drfa_lambda_sampling_end_to_end() -> None:
    """DRFA draws the cohort from lambda (repeats as multiplicity), the scheduler sizes whoever is drawn; lambda moves
    and the levels are set for exactly the drawn clients."""
    data = store([6, 7, 8, 5, 9, 6])
    lam, part = LambdaSampling(gamma=0.3, eval_batch=4), Subnetwork(scheduler="se_only", u_th=50.0)
    fed = fed_with([lam, part], data, clients_per_round=4)
    for r in range(3):
        run_rounds(fed, 1, start=r)
        assert set(part.levels) == set(fed.rnd.cohort)
    assert not torch.allclose(lam.lam, torch.full((6,), 1 / 6, dtype=torch.float64))
    assert fed.clock.elapsed > 0


def test_state_dict_round_trip() -> None:
    part = Subnetwork()
    fed = fed_with([part], store([6, 7]))
    run_rounds(fed, 2)
    other = Subnetwork()
    other.load_state_dict(part.state_dict())
    assert other.windows == part.windows and len(other.windows[0]) == 2


def test_static_bn_is_rebuilt_on_the_training_rows_around_evaluation() -> None:
    """Validation start: every sBN layer gets the statistics of rebuild_bn_stats over all training rows; epoch end:
    cleared, so they never outlive the weights."""
    data = store([6, 7])
    part = Subnetwork(scheduler="fixed")
    fed = fed_with([part], data)
    run_rounds(fed, 1)
    ref = copy.deepcopy(fed.net)
    rebuild_bn_stats(ref, data.x, 1024)
    part.on_validation_epoch_start(None, fed.net)
    layers = [m for m in fed.net.modules() if isinstance(m, StaticBatchNorm2d)]
    refs = [m for m in ref.modules() if isinstance(m, StaticBatchNorm2d)]
    for m, r in zip(layers, refs):
        torch.testing.assert_close(m.stat_mean, r.stat_mean, rtol=0, atol=0)
        torch.testing.assert_close(m.stat_var, r.stat_var, rtol=0, atol=0)
    part.on_validation_epoch_end(None, fed.net)
    assert all(m.stat_mean is None for m in layers)


def test_schedulers_that_never_read_te_skip_the_fisher() -> None:
    """The per-batch Fisher is the costliest part of a round: ``fixed`` / ``full`` / ``se_only`` skip it unless
    ``track_fisher`` asks, and then log no ``whale/fi_mean``; ``whale`` and ``te_only`` always track it."""
    assert Subnetwork(scheduler="whale").track_fisher and Subnetwork(scheduler="te_only").track_fisher
    part = Subnetwork(scheduler="fixed")
    assert not part.track_fisher and not Subnetwork(scheduler="full").track_fisher
    fed = fed_with([part], store([7]), lr=0.1)
    run_rounds(fed, 1)
    assert part.windows[0] == [] and "whale/fi_mean" not in part._log


def test_fisher_batches_keeps_the_first_steps_only() -> None:
    """``fisher_batches=1``: the window gets FI_0^2 of the round's first step alone (K = 2 full-batch steps)."""
    data = store([7])
    part = Subnetwork(scheduler="fixed", fisher_samples=None, track_fisher=True, fisher_batches=1)
    fed = fed_with([part], data, lr=0.1)
    ref = copy.deepcopy(fed.net)
    run_rounds(fed, 1)
    fi0 = float(wu.batch_fisher_tensor(ref, F.cross_entropy, data.x, data.y, None))
    assert part.windows[0] == pytest.approx([fi0**2], rel=1e-9)
    raises_one_line(Subnetwork, fisher_batches=0, match="algo.fisher_batches")


@pytest.mark.parametrize("extractor", ["prefix", "random"])
def test_a_client_of_the_masked_lm_trains_the_extracted_small_lm(extractor: str) -> None:
    """One client at width 1/2 (``max_levels``: level 2) on the Transformer LM, one full-batch SGD step: the part
    hands the sub-model's index sets to ``set_width`` (masked LayerNorm, the sub-model's softmax scale), so the merged
    model's slices are those of an independent small LM (``embed 4``, 2 heads of 2, ``ffn 6``) after the same step on
    the same rows, and every entry outside them is unchanged (count mean, one client)."""
    from flx.models.scalable_lm import ScalableTransformerLM
    from flx.models.width import extract_state, local_entries, width_indices
    from flx.parts.systems.subnetwork import _MASK_TAG
    from flx.sampling import derive_seed
    from flx.tasks import MaskedLM

    def lm(**kw: int) -> ScalableTransformerLM:
        torch.manual_seed(0)
        sizes = dict(input_shape=(5,), num_classes=6, embed=8, heads=2, ffn=12, layers=1, dropout=0.0)
        return ScalableTransformerLM(**{**sizes, **kw}).double()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 7, (6, 5), generator=g), torch.randint(0, 6, (6, 5), generator=g)
    data = ClientStore(x, torch.where(torch.rand(6, 5, generator=g) < 0.4, y, -100), [torch.arange(6)])
    part = Subnetwork(scheduler="fixed", extractor=extractor, max_levels={**MAX_LEVELS, "MacBookPro2018": 2})
    net, loss = lm(), MaskedLM().loss
    fed = fed_with([part], data, net=net, loss_fn=loss, local_steps=1, lr=0.1)
    gen = torch.Generator().manual_seed(derive_seed(CFG["seed"], 0, 0, _MASK_TAG))
    indices = width_indices(net, 0.5, extractor, generator=gen)
    w0 = {n: p.detach().clone() for n, p in local_entries(net)}
    small = lm(embed=4, attn_dim=4, ffn=6)
    small.load_state_dict(extract_state(net, indices))
    small.set_width(0.5)
    loss(small(data.x), data.y).backward()
    run_rounds(fed, 1)
    assert fed.rnd.width(0) == 0.5
    got = extract_state(net, indices)
    for name, p in small.named_parameters():
        torch.testing.assert_close(got[name], (p - 0.1 * p.grad).detach(), rtol=1e-12, atol=1e-12)
    masks = dict(zip(w0, masks_from_indices(net, indices)))
    for name, p in local_entries(net):
        assert torch.equal(p.detach()[masks[name] == 0], w0[name][masks[name] == 0]), name
