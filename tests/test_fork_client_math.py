"""The judge client's FORK math on plain numbers against the tensor reference."""

import random

import pytest
import torch

from creditlab.core.precision import COMBINE_MODES, fork_scores, fork_scores_one, unit_credit, unit_credit_one


def _case(rng: random.Random):
    J, n = rng.randint(1, 12), rng.randint(0, 15)
    match = [[rng.random() < 0.3 for _ in range(n)] for _ in range(J)]
    points = [rng.choice([rng.randint(-10, 10), round(rng.uniform(-5, 5), 3)]) for _ in range(J)]
    coverage = [rng.random() < 0.5 for _ in range(J)]
    correct = [rng.random() < 0.8 for _ in range(n)]
    tau = rng.choice([0.25, 1 / 3, 0.5, 1.0, rng.uniform(0.01, 2.0)])
    return J, n, match, points, coverage, correct, tau


@pytest.mark.parametrize("mode", COMBINE_MODES)
def test_plain_fork_math_agrees_with_the_tensor_math_to_float32_rounding(mode):
    rng = random.Random(mode)
    for _ in range(400):
        J, n, match, points, coverage, correct, tau = _case(rng)
        beta = rng.choice([1.0, 0.5, 2.0, rng.uniform(1e-3, 1e3)])
        m = torch.tensor(match, dtype=torch.bool).reshape(1, J, n)
        w = torch.tensor([points], dtype=torch.float32)
        rmask, umask = torch.ones(1, J, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool)
        cov, corr = torch.tensor([coverage]).reshape(1, J), torch.tensor([correct], dtype=torch.bool).reshape(1, n)
        ref = fork_scores(m, cov, w, corr, rmask, umask, tau=tau, beta=beta, mode=mode)
        got = fork_scores_one(match, coverage, points, correct, tau, beta, mode)
        tol = 1e-6  # float32 rounding of the reference, a few ulp of values <= 1 (credits: <= J)
        for a, b in ((got.reward, ref.reward), (got.precision, ref.precision), (got.recall, ref.recall)):
            assert abs(a - float(b[0])) <= tol
        assert got.credits == pytest.approx(ref.credits[0].tolist(), abs=tol * J)
        assert got.credits == pytest.approx(unit_credit(m, rmask & (w > 0), umask)[0].tolist(), abs=tol * J)
        assert got.credits == unit_credit_one(match, [p > 0 for p in points])
        assert got.necessary == ref.necessary[0].tolist()
        # what a client reports (6 decimals) is the same
        assert [round(c, 6) for c in got.credits] == pytest.approx([round(c, 6) for c in ref.credits[0].tolist()],
                                                                    abs=1.01e-6)
