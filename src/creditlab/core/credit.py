"""Credit geometries: how a trajectory's terminal advantage is spread over its steps.

Every function works on a ``(B, T)`` step tensor with a boolean ``step_mask`` (True on real
steps; a step is a turn or an action segment) and returns ``(B, T)`` per-step credit that is 0 on
masked steps. ``advantages`` is ``(B,)`` (e.g. :func:`creditlab.core.advantages.grpo_advantages`).

With ``conserve=True`` each rollout's credit satisfies ``sum_t |a[i,t]| = |A_i|`` (all arms get the
same total credit, so comparisons between shapes are at equal budget); with ``conserve=False`` the
unnormalised shape is returned (e.g. plain GRPO broadcast, ``A_i`` on every step).

Shapes follow docs/design.md section 3:

* uniform: ``a[i,t] = A_i / T_i``  (``conserve=False``: ``A_i``)
* per_turn: ``a[i,t] = A_i dS[i,t] / sum_u dS[i,u]``, uniform fallback when ``sum dS = 0``
* concentrated(selected): ``a[i,t] = A_i / k_i`` on the ``k_i`` selected steps (uniform fallback
  when none is selected)
* random_k: concentrated on ``k`` steps per rollout chosen at random (the ``k`` smallest of uniform
  random keys) — the same concentration as a budget-``k`` verifier, with no information
* targeted(local, exposed): a local per-step signal ``s``, normalised per step over the rollouts of
  the group, ``loc[i,t] = (s[i,t] - mean_g s[:,t]) / (std_g s[:,t] + eps)`` on exposed steps (0
  elsewhere), spread so that ``sum_t |a[i,t]| = |A_i|``: ``a = loc |A_i| / sum_t |loc|`` (0 when
  the row's ``sum_t |loc| = 0``). Its sign is the local signal's, not ``A_i``'s.
* shuffled: a row's credit permuted to random real steps of the same row (same concentration, no
  targeting information) — the control for any "targeted credit aims well" claim
* binary / discretized: outcome rounded to {0,1} / to a few levels, then GRPO, then uniform
* reward_to_go: ``a[i,t] = (sum_{u>=t} r[i,u] - mean_g R) / (std_g R + eps)`` with
  ``R_i = sum_u r[i,u]``; with terminal-only reward it is constant over t, i.e. uniform.
* prm: ``a[i,t] = A_i + lam A_proc[i,t]`` (:func:`creditlab.core.advantages.mix_process_advantage`).

Registry
--------
Every geometry is also registered by name in :data:`GEOMETRIES` with one common signature,
``fn(batch: StepBatch, *, conserve: bool = True, **params) -> (B, T) credit``, where
:class:`StepBatch` carries every per-batch input a geometry may read. Trainers and labs look
geometries up there (:func:`get_geometry`, :func:`geometry_params`, :func:`geometry_needs`), so a
geometry added with :func:`register_geometry` is usable everywhere without touching them. The
registered functions are thin adapters over the public functions of this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import torch

from creditlab.core._checks import any_true, check_scalar, check_tensor, require_values
from creditlab.core.advantages import group_stats, grpo_advantages, mix_process_advantage
from creditlab.core.registry import Registry, check_name, keyword_parameters, signature_of
from creditlab.errors import ConfigError, InputError

__all__ = [
    "GEOMETRIES",
    "GeometryFn",
    "StepBatch",
    "binary",
    "concentrated",
    "conserve_credit",
    "discretized",
    "geometry_needs",
    "geometry_params",
    "get_geometry",
    "per_turn",
    "random_k",
    "random_k_mask",
    "register_geometry",
    "registered_geometry",
    "reward_to_go",
    "shuffled",
    "targeted",
    "uniform",
    "unregister_geometry",
]


def _check_adv_mask(advantages: torch.Tensor, step_mask: torch.Tensor) -> dict[str, int]:
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("advantages", advantages, shape=("B",), floating=True, finite=True, dims=dims)
    return dims


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


def _spread(advantages: torch.Tensor, weights: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """``A_i * w[i,t] / sum_u w[i,u]`` on real steps, uniform where the row's weight sum is 0."""
    w = torch.where(step_mask, weights, torch.zeros_like(weights))
    total = w.sum(-1, keepdim=True)
    n = step_mask.sum(-1, keepdim=True).clamp_min(1).to(w.dtype)
    share = torch.where(total > 0, w / torch.where(total > 0, total, torch.ones_like(total)), step_mask / n)
    return _masked(advantages.unsqueeze(-1) * share, step_mask)


def uniform(advantages: torch.Tensor, step_mask: torch.Tensor, *, conserve: bool = True) -> torch.Tensor:
    """Same credit on every real step: ``A_i / T_i`` (``conserve``) or ``A_i`` (GRPO broadcast).

    >>> uniform(torch.tensor([2.0, -1.0]), torch.tensor([[True, True], [True, False]]))
    tensor([[ 1.,  1.],
            [-1.,  0.]])
    """
    _check_adv_mask(advantages, step_mask)
    if conserve:
        return _spread(advantages, step_mask.to(advantages.dtype), step_mask)
    return _masked(advantages.unsqueeze(-1).expand_as(step_mask).clone(), step_mask)


def per_turn(advantages: torch.Tensor, progress_deltas: torch.Tensor, step_mask: torch.Tensor, *,
             conserve: bool = True) -> torch.Tensor:
    """Credit only where the verifier saw progress: ``A_i dS[i,t] / sum_u dS[i,u]``.

    ``progress_deltas`` ``(B, T)``: non-negative progress gained at each step (e.g. the increase of a
    state-diff verifier's score). Rows with no progress fall back to uniform. With
    ``conserve=False`` the weights are ``dS`` itself (``A_i dS[i,t]``), uniform ``A_i`` fallback.
    """
    dims = _check_adv_mask(advantages, step_mask)
    check_tensor("progress_deltas", progress_deltas, shape=("B", "T"), floating=True, finite=True,
                 finite_where=step_mask, dims=dims)
    dS = torch.where(step_mask, progress_deltas, torch.zeros_like(progress_deltas)).to(advantages.dtype)
    if any_true(dS < 0):
        raise InputError("progress_deltas: must be >= 0 on real steps (take the positive part of the progress)")
    if conserve:
        return _spread(advantages, dS, step_mask)
    has = dS.sum(-1, keepdim=True) > 0
    return _masked(advantages.unsqueeze(-1) * torch.where(has, dS, step_mask.to(dS.dtype)), step_mask)


def concentrated(advantages: torch.Tensor, selected_mask: torch.Tensor, step_mask: torch.Tensor, *,
                 conserve: bool = True) -> torch.Tensor:
    """Credit only on the selected steps (``A_i / k_i`` each), uniform fallback when none is selected.

    >>> concentrated(torch.tensor([3.0]), torch.tensor([[True, False, True]]), torch.tensor([[True] * 3]))
    tensor([[1.5000, 0.0000, 1.5000]])
    """
    dims = _check_adv_mask(advantages, step_mask)
    check_tensor("selected_mask", selected_mask, shape=("B", "T"), boolean=True, dims=dims)
    sel = (selected_mask & step_mask).to(advantages.dtype)
    if conserve:
        return _spread(advantages, sel, step_mask)
    has = sel.sum(-1, keepdim=True) > 0
    return _masked(advantages.unsqueeze(-1) * torch.where(has, sel, step_mask.to(sel.dtype)), step_mask)


def shuffled(credit: torch.Tensor, step_mask: torch.Tensor, generator: torch.Generator | None = None, *,
             keys: torch.Tensor | None = None) -> torch.Tensor:
    """Permute each row's credit among that row's real steps, uniformly at random.

    Matches the concentration (the multiset of per-step values, hence ``sum |a|``) of ``credit``
    and removes its targeting information. Masked steps stay 0. ``keys`` ``(B, T)``: optional
    uniform random keys to use instead of drawing from ``generator`` (so a caller can keep one
    random stream per seed); the permutation sorts the real steps by key.
    """
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("credit", credit, shape=("B", "T"), floating=True, finite=True, finite_where=step_mask, dims=dims)
    B, T = step_mask.shape
    # source order: real steps first, in order; destination order: real steps first, at random
    idx = torch.arange(T, device=credit.device).expand(B, T)
    src = torch.argsort((~step_mask).to(torch.int64) * T + idx, dim=-1)
    if keys is None:
        gen_device = credit.device if generator is None else generator.device
        keys = torch.rand(B, T, generator=generator, device=gen_device).to(credit.device)
    else:
        check_tensor("keys", keys, shape=("B", "T"), floating=True, finite=True, dims=dims)
    dst = torch.argsort(torch.where(step_mask, keys, torch.full_like(keys, float("inf"))), dim=-1)
    vals = torch.gather(torch.where(step_mask, credit, torch.zeros_like(credit)), -1, src)
    out = torch.zeros_like(credit).scatter(-1, dst, vals)
    return _masked(out, step_mask)


def binary(rewards: torch.Tensor, group_ids: torch.Tensor, step_mask: torch.Tensor, *, threshold: float = 1.0,
           eps: float = 1e-6, conserve: bool = True) -> torch.Tensor:
    """Outcome reduced to success ``1[R_i >= threshold]``, GRPO-normalised, spread uniformly."""
    require_values("binary", "the group count comes from the data (torch.unique)", rewards, group_ids, step_mask)
    check_tensor("rewards", rewards, shape=(None,), floating=True, finite=True)
    check_scalar("threshold", threshold)
    outcome = (rewards >= threshold).to(rewards.dtype)
    return uniform(grpo_advantages(outcome, group_ids, eps), step_mask, conserve=conserve)


def discretized(rewards: torch.Tensor, group_ids: torch.Tensor, step_mask: torch.Tensor, *,
                levels: tuple[float, ...] = (0.0, 0.5, 1.0), eps: float = 1e-6,
                conserve: bool = True) -> torch.Tensor:
    """Outcome rounded to the nearest of ``levels`` (ties go to the lower level), GRPO-normalised,
    spread uniformly."""
    require_values("discretized", "the group count comes from the data (torch.unique)", rewards, group_ids, step_mask)
    check_tensor("rewards", rewards, shape=(None,), floating=True, finite=True)
    if len(levels) < 1:
        raise InputError("levels: needs at least one level")
    lv = torch.tensor(sorted(levels), dtype=rewards.dtype, device=rewards.device)
    nearest = lv[(rewards.unsqueeze(-1) - lv).abs().argmin(-1)]
    return uniform(grpo_advantages(nearest, group_ids, eps), step_mask, conserve=conserve)


def reward_to_go(step_rewards: torch.Tensor, group_ids: torch.Tensor, step_mask: torch.Tensor, *,
                 eps: float = 1e-6, conserve: bool = False) -> torch.Tensor:
    """``a[i,t] = (G[i,t] - mean_g R) / (std_g R + eps)`` with ``G[i,t] = sum_{u>=t} r[i,u]`` and
    ``R_i = G[i,0]`` (the group statistics of the full return, as GRPO).

    With a terminal-only reward ``G[i,t] = R_i`` for every t: the GRPO broadcast (uniform). With
    ``conserve=True`` each row is rescaled so ``sum_t |a[i,t]| = |A_i|`` (``A_i`` the GRPO advantage
    of ``R_i``).
    """
    require_values("reward_to_go", "the group count comes from the data (torch.unique)",
                   step_rewards, group_ids, step_mask)
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("step_rewards", step_rewards, shape=("B", "T"), floating=True, finite=True,
                 finite_where=step_mask, dims=dims)
    r = torch.where(step_mask, step_rewards, torch.zeros_like(step_rewards))
    togo = r.flip(-1).cumsum(-1).flip(-1)
    R = r.sum(-1)
    mean, std, _ = group_stats(R, group_ids)
    a = _masked((togo - mean.unsqueeze(-1)) / (std.unsqueeze(-1) + eps), step_mask)
    if conserve:
        return conserve_credit(a, (R - mean) / (std + eps), step_mask)
    return a


def conserve_credit(credit: torch.Tensor, advantages: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """Rescale each row so ``sum_t |a[i,t]| = |A_i|``; a row with no credit gets ``A_i`` spread uniformly."""
    _check_adv_mask(advantages, step_mask)
    c = torch.where(step_mask, credit, torch.zeros_like(credit))
    mass = c.abs().sum(-1, keepdim=True)
    scaled = c * (advantages.abs().unsqueeze(-1) / torch.where(mass > 0, mass, torch.ones_like(mass)))
    return torch.where(mass > 0, scaled, uniform(advantages, step_mask, conserve=True))


def random_k_mask(keys: torch.Tensor, k: int | torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the ``k`` real steps of each row with the smallest ``keys``.

    ``rank = keys.argsort(-1).argsort(-1)`` (masked steps are ranked last by giving them key +inf),
    ``selected = (rank < k) & step_mask``. ``k``: an int >= 0 or a ``(B,)`` integer tensor (one budget
    per rollout; its values are not read on the host). A row with fewer than ``k`` real steps has
    all of them selected.

    >>> random_k_mask(torch.tensor([[0.3, 0.1, 0.9, 0.2]]), 2, torch.tensor([[True, True, True, False]]))
    tensor([[ True,  True, False, False]])
    """
    dims: dict[str, int] = {}
    check_tensor("step_mask", step_mask, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("keys", keys, shape=("B", "T"), floating=True, finite=True, finite_where=step_mask, dims=dims,
                 device=step_mask.device)
    if isinstance(k, torch.Tensor):
        check_tensor("k", k, shape=("B",), integer=True, dims=dims, device=step_mask.device)
        budget = k.unsqueeze(-1)
    else:
        if isinstance(k, bool) or int(k) != k or k < 0:
            raise ConfigError("k", f"must be a non-negative integer, got {k!r}")
        budget = int(k)
    key = torch.where(step_mask, keys, torch.full_like(keys, float("inf")))
    rank = key.argsort(-1).argsort(-1)
    return (rank < budget) & step_mask


def random_k(advantages: torch.Tensor, keys: torch.Tensor, k: int | torch.Tensor, step_mask: torch.Tensor, *,
             conserve: bool = True) -> torch.Tensor:
    """:func:`concentrated` on :func:`random_k_mask` ``(keys, k)``: ``A_i / k`` on ``k`` random real steps.

    ``keys`` ``(B, T)`` uniform random keys (one stream per seed is the caller's: draw them from a
    ``torch.Generator``). The chain lab's ``random_k`` arm.

    >>> random_k(torch.tensor([2.0]), torch.tensor([[0.3, 0.1, 0.9, 0.2]]), 2, torch.ones(1, 4, dtype=torch.bool))
    tensor([[0., 1., 0., 1.]])
    """
    return concentrated(advantages, random_k_mask(keys, k, step_mask), step_mask, conserve=conserve)


def _equal_blocks(group_ids: torch.Tensor, step_mask: torch.Tensor) -> int | None:
    """``G`` when the groups are contiguous blocks of ``G >= 2`` rows with distinct labels and every
    step is real (the layout of a lab's ``(M, G, T)`` batch), else None. Two host reads."""
    B = group_ids.shape[0]
    if B < 2:
        return None
    G = int((group_ids == group_ids[0]).sum())
    if G < 2 or B % G:
        return None
    blocks = group_ids.view(B // G, G)
    heads = blocks[:, 0].sort().values
    ok = (blocks == blocks[:, :1]).all() & (heads[1:] != heads[:-1]).all() & step_mask.all()
    return G if bool(ok) else None


def _group_step_z(s: torch.Tensor, step_mask: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """``(s - mean_g s[:,t]) / (std_g s[:,t] + eps)`` over the rows of each group that have step ``t``
    (unbiased std, 0 for fewer than two), float64, by scatter sums; 0 on masked steps."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=s.device)
    v = torch.where(step_mask, s.to(f64), zero)
    shape = (n_groups, s.shape[1])
    count = torch.zeros(shape, dtype=f64, device=s.device).index_add_(0, inverse, step_mask.to(f64))
    mean = torch.zeros(shape, dtype=f64, device=s.device).index_add_(0, inverse, v) / count.clamp_min(1)
    centred = torch.where(step_mask, v - mean[inverse], zero)
    sq = torch.zeros(shape, dtype=f64, device=s.device).index_add_(0, inverse, centred.square())
    std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), zero)
    return centred / (std[inverse] + eps)


def targeted(advantages: torch.Tensor, local: torch.Tensor, exposed: torch.Tensor, group_ids: torch.Tensor,
             step_mask: torch.Tensor, *, eps: float = 1e-6, conserve: bool = True) -> torch.Tensor:
    """Credit from a local per-step signal, group-normalised per step, on the exposed steps.

    ``loc[i,t] = (s[i,t] - mean_g s[:,t]) / (std_g s[:,t] + eps)`` where ``exposed & step_mask``,
    0 elsewhere (mean and unbiased std over the rollouts of ``i``'s group that have step ``t``; a
    step seen by one rollout only gets 0); then ``a[i,t] = loc[i,t] |A_i| / sum_u |loc[i,u]|``, so
    ``sum_t |a[i,t]| = |A_i|``, and 0 for a row whose ``sum_u |loc[i,u]|`` is 0 (no uniform
    fallback: nothing local was seen). ``conserve=False``: ``loc[i,t] |A_i|``.

    Args:
        advantages: ``(B,)`` outcome advantage ``A_i`` (only its magnitude is used).
        local: ``(B, T)`` float local signal (e.g. per-step correctness a verifier can see).
        exposed: ``(B, T)`` bool, steps the local signal is observed on.
        group_ids: ``(B,)`` integer group labels.
        step_mask: ``(B, T)`` bool real steps.
        eps: added to the per-step group std.

    Arithmetic: computed in ``promote_types(local, advantages)``. When the groups are contiguous
    blocks of equal size ``G >= 2`` and every step is real (a lab's ``(M, G, T)`` batch), the group
    statistics are ``.mean(1)`` / ``.std(1)`` over the ``(B // G, G, T)`` view, in that dtype (the
    chain lab's arithmetic, bit for bit); otherwise float64 scatter sums.

    >>> targeted(torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
    ...          torch.tensor([[True, False], [True, False]]), torch.tensor([0, 0]), torch.ones(2, 2, dtype=torch.bool))
    tensor([[ 2.,  0.],
            [-1.,  0.]])
    """
    require_values("targeted", "it reads the group layout on the host",
                   advantages, local, exposed, group_ids, step_mask)
    dims = _check_adv_mask(advantages, step_mask)
    check_tensor("local", local, shape=("B", "T"), floating=True, finite=True, finite_where=step_mask, dims=dims)
    check_tensor("exposed", exposed, shape=("B", "T"), boolean=True, dims=dims)
    check_tensor("group_ids", group_ids, shape=("B",), integer=True, dims=dims)
    check_scalar("eps", eps, low=0.0, low_open=True)
    dt = torch.promote_types(local.dtype, advantages.dtype)
    s = local.to(dt)
    B, T = s.shape
    if B == 0:
        return torch.zeros_like(s)
    G = _equal_blocks(group_ids, step_mask)
    if G is not None:
        x = s.view(B // G, G, T)
        mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True)
        z = ((x - mu) / (sd + eps)).view(B, T)
    else:
        z = _group_step_z(s, step_mask, group_ids, eps).to(dt)
    loc = torch.where(exposed & step_mask, z, torch.zeros_like(z))
    magnitude = advantages.to(dt).abs().unsqueeze(-1)
    if not conserve:
        return loc * magnitude
    mass = loc.abs().sum(-1, keepdim=True)
    return torch.where(mass > 0, loc * magnitude / mass.clamp_min(1e-12), torch.zeros_like(loc))


# --------------------------------------------------------------------------------------------
# the registry of geometries


class StepBatch(NamedTuple):
    """Everything a credit geometry may read about one batch of ``B`` rollouts of ``T`` steps.

    Attributes:
        step_mask: ``(B, T)`` bool, real steps.
        group_ids: ``(B,)`` integer group labels (rollouts of one prompt share one).
        advantages: ``(B,)`` outcome advantage ``A_i``, or None (then the GRPO advantage of
            ``rewards`` is used, with the geometry's ``eps``).
        rewards: ``(B,)`` outcome reward ``R_i``, or None (``binary`` / ``discretized`` need it).
        step_scores: ``(B, T)`` per-step score, or None: progress ``dS >= 0`` for ``per_turn`` and
            ``shuffled``, selection ``score > 0`` for ``concentrated``, step reward for
            ``reward_to_go``, process score for ``prm``, local signal for ``targeted``.
        selected: ``(B, T)`` bool, or None: the selection of ``concentrated`` (instead of
            ``step_scores > 0``) and the exposed steps of ``targeted`` (None: every real step).
        keys: ``(B, T)`` uniform random keys, or None (``shuffled`` / ``random_k`` then draw them from
            their ``generator``).
    """

    step_mask: torch.Tensor
    group_ids: torch.Tensor
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    step_scores: torch.Tensor | None = None
    selected: torch.Tensor | None = None
    keys: torch.Tensor | None = None


#: A geometry: ``fn(batch: StepBatch, *, conserve: bool = True, **params) -> (B, T)`` credit.
GeometryFn = Callable[..., torch.Tensor]

#: Every registered geometry by name (read it; register with :func:`register_geometry`).
GEOMETRIES: Registry[GeometryFn] = Registry("geometry", validate=lambda fn: _geometry_parameters(fn))
_NEEDS: dict[str, frozenset[str]] = {}
_NEED_FIELDS = frozenset({"advantages", "rewards", "step_scores", "selected", "keys"})
_F = TypeVar("_F", bound=Callable[..., Any])


def _geometry_parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Keyword parameters of a geometry other than ``conserve``; :class:`ConfigError` if ``fn`` is not one."""
    sig = signature_of(fn, "geometry")
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p for p in params if p.kind is p.KEYWORD_ONLY]
    if len(positional) != 1 or "conserve" not in {p.name for p in keyword}:
        raise ConfigError("geometry", f"a geometry is fn(batch, *, conserve=True, params...), got {fn.__name__}{sig}")
    return tuple(n for n in keyword_parameters(fn, sig, keyword, "geometry", "geometry") if n != "conserve")


def register_geometry(name: str, *, needs: Iterable[str] = ("advantages",)) -> Callable[[_F], _F]:
    """Decorator registering a geometry under ``name`` in :data:`GEOMETRIES`.

    The geometry is ``fn(batch: StepBatch, *, conserve: bool = True, param=default, ...) -> (B, T)``;
    its parameters are named, with defaults. ``needs``: the :class:`StepBatch` fields it must be
    given when ``selected`` / ``keys`` are not (``"advantages"`` is satisfied by ``rewards`` too):
    the trainer integrations check them before a run and fill ``keys`` themselves. Registering the
    same function again is a no-op; another function under a taken name raises
    :class:`ConfigError`. Use a module-level function (not a lambda) so that it pickles.
    """
    check_name(name, "geometry", "geometry")
    wanted = frozenset(needs)
    if not wanted <= _NEED_FIELDS:
        raise ConfigError("needs", f"unknown field(s) {sorted(wanted - _NEED_FIELDS)}; valid: "
                                   f"{', '.join(sorted(_NEED_FIELDS))}")

    def register(fn: _F) -> _F:
        new = name not in GEOMETRIES
        GEOMETRIES.register(name, fn)
        if new:  # registering the same function again keeps its needs
            _NEEDS[name] = wanted
        return fn

    return register


def unregister_geometry(name: str) -> GeometryFn:
    """Remove the geometry ``name`` from :data:`GEOMETRIES` and return it (tests, notebooks)."""
    fn = GEOMETRIES.unregister(name)
    _NEEDS.pop(name, None)
    return fn


@contextlib.contextmanager
def registered_geometry(name: str, fn: GeometryFn, *, needs: Iterable[str] = ("advantages",)
                        ) -> Iterator[GeometryFn]:
    """``with registered_geometry("mine", fn):`` registers ``fn`` for the block, then removes it."""
    register_geometry(name, needs=needs)(fn)
    try:
        with GEOMETRIES.registered(name, fn):
            yield fn
    finally:
        if name not in GEOMETRIES:
            _NEEDS.pop(name, None)


def get_geometry(name: str) -> GeometryFn:
    """The geometry registered as ``name``; :class:`ConfigError` listing every registered name otherwise.

    >>> batch = StepBatch(torch.ones(1, 2, dtype=torch.bool), torch.tensor([0]), advantages=torch.tensor([3.0]))
    >>> get_geometry("uniform")(batch)
    tensor([[1.5000, 1.5000]])
    """
    return GEOMETRIES.get(name)


def geometry_params(name: str) -> tuple[str, ...]:
    """The keyword parameters (besides ``conserve``) the geometry ``name`` accepts, from its signature.

    >>> geometry_params("prm"), geometry_params("random_k")
    (('lam', 'eps'), ('k', 'eps', 'generator'))
    """
    return _geometry_parameters(get_geometry(name))


def geometry_needs(name: str) -> frozenset[str]:
    """The :class:`StepBatch` fields the geometry ``name`` must be given (see :func:`register_geometry`)."""
    get_geometry(name)
    return _NEEDS[name]


def _field(batch: StepBatch, field: str, geometry: str) -> torch.Tensor:
    x = getattr(batch, field)
    if x is None:
        what = {"step_scores": "a per-turn score", "rewards": "the outcome rewards"}[field]
        raise InputError(f"{field}: geometry {geometry!r} needs {what}")
    return x


def _advantages(batch: StepBatch, eps: float) -> torch.Tensor:
    """``A_i``: ``batch.advantages``, else the GRPO advantage of ``batch.rewards``."""
    if batch.advantages is not None:
        return batch.advantages
    if batch.rewards is None:
        raise InputError("advantages: pass the outcome advantages or the outcome rewards")
    return grpo_advantages(batch.rewards, batch.group_ids, eps)


def _draw_keys(step_mask: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    device = step_mask.device if generator is None else generator.device
    return torch.rand(step_mask.shape, generator=generator, device=device).to(step_mask.device)


@register_geometry("uniform")
def _uniform(batch: StepBatch, *, conserve: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``uniform``: :func:`uniform` of ``A_i``."""
    return uniform(_advantages(batch, eps), batch.step_mask, conserve=conserve)


@register_geometry("per_turn", needs=("advantages", "step_scores"))
def _per_turn(batch: StepBatch, *, conserve: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``per_turn``: :func:`per_turn` with ``step_scores`` as the progress ``dS``."""
    dS = _field(batch, "step_scores", "per_turn")
    return per_turn(_advantages(batch, eps), dS, batch.step_mask, conserve=conserve)


@register_geometry("concentrated", needs=("advantages", "step_scores"))
def _concentrated(batch: StepBatch, *, conserve: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``concentrated``: :func:`concentrated` on ``selected`` (else ``step_scores > 0``)."""
    sel = batch.selected if batch.selected is not None else _field(batch, "step_scores", "concentrated") > 0
    return concentrated(_advantages(batch, eps), sel, batch.step_mask, conserve=conserve)


@register_geometry("shuffled", needs=("advantages", "step_scores"))
def _shuffled(batch: StepBatch, *, conserve: bool = True, eps: float = 1e-6,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Registered ``shuffled``: the ``per_turn`` credit permuted by :func:`shuffled` (``keys``, else drawn
    from ``generator``)."""
    dS = _field(batch, "step_scores", "shuffled")
    base = per_turn(_advantages(batch, eps), dS, batch.step_mask, conserve=conserve)
    if batch.keys is None:
        return shuffled(base, batch.step_mask, generator)
    return shuffled(base, batch.step_mask, keys=batch.keys.to(base.dtype))


@register_geometry("binary", needs=("rewards",))
def _binary(batch: StepBatch, *, conserve: bool = True, threshold: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``binary``: :func:`binary` of ``rewards``."""
    rewards = _field(batch, "rewards", "binary")
    return binary(rewards, batch.group_ids, batch.step_mask, threshold=threshold, eps=eps, conserve=conserve)


@register_geometry("discretized", needs=("rewards",))
def _discretized(batch: StepBatch, *, conserve: bool = True, levels: tuple[float, ...] = (0.0, 0.5, 1.0),
                 eps: float = 1e-6) -> torch.Tensor:
    """Registered ``discretized``: :func:`discretized` of ``rewards``."""
    rewards = _field(batch, "rewards", "discretized")
    return discretized(rewards, batch.group_ids, batch.step_mask, levels=levels, eps=eps, conserve=conserve)


@register_geometry("reward_to_go", needs=("step_scores",))
def _reward_to_go(batch: StepBatch, *, conserve: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``reward_to_go``: :func:`reward_to_go` with ``step_scores`` as the step rewards."""
    r = _field(batch, "step_scores", "reward_to_go")
    return reward_to_go(r, batch.group_ids, batch.step_mask, eps=eps, conserve=conserve)


@register_geometry("prm", needs=("advantages", "step_scores"))
def _prm(batch: StepBatch, *, conserve: bool = True, lam: float = 0.5, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``prm``: ``A_i + lam A_proc[i,t]`` with ``A_proc`` the group-normalised process score
    ``step_scores`` (:func:`~creditlab.core.advantages.mix_process_advantage`: with ``A_i`` the GRPO
    advantage of the rewards it equals :func:`~creditlab.core.advantages.prm_mixed_advantages` bit for
    bit); ``conserve`` rescales each row to ``sum_t |a| = |A_i|``. ``lam`` is the weight at this update
    (a trainer evaluates its :class:`~creditlab.core.schedules.Schedule` at its step)."""
    scores = _field(batch, "step_scores", "prm")
    A = _advantages(batch, eps)
    out = mix_process_advantage(A, scores, batch.step_mask, batch.group_ids, lam, eps=eps)
    out = torch.where(batch.step_mask, out, torch.zeros_like(out)).to(A.dtype)
    return conserve_credit(out, A, batch.step_mask) if conserve else out


@register_geometry("random_k")
def _random_k(batch: StepBatch, *, conserve: bool = True, k: int | torch.Tensor = 1, eps: float = 1e-6,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Registered ``random_k``: :func:`random_k` with ``keys`` (else drawn from ``generator``)."""
    keys = batch.keys if batch.keys is not None else _draw_keys(batch.step_mask, generator)
    return random_k(_advantages(batch, eps), keys, k, batch.step_mask, conserve=conserve)


@register_geometry("targeted", needs=("advantages", "step_scores"))
def _targeted(batch: StepBatch, *, conserve: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Registered ``targeted``: :func:`targeted` of the local signal ``step_scores`` on the exposed steps
    ``selected`` (None: every real step)."""
    local = _field(batch, "step_scores", "targeted")
    exposed = batch.selected if batch.selected is not None else batch.step_mask
    return targeted(_advantages(batch, eps), local, exposed, batch.group_ids, batch.step_mask, eps=eps,
                    conserve=conserve)
