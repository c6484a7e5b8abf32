"""pass@k from n samples per problem, c of them correct: the unbiased estimator of Chen et al.
2021 ("Evaluating Large Language Models Trained on Code", eq. 1),

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ],

computed as a running product 1 - prod_{i = n-c+1}^{n} (1 - k / i) to stay exact for large n
(no huge binomials). Needs k <= n; c >= n - k + 1 gives exactly 1.
"""
from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with n samples, c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems; correct[p] = one bool per sample of problem p."""
    if not correct:
        raise ValueError("mean_pass_at_k: no problems")
    return sum(pass_at_k(len(c), sum(map(bool, c)), k) for c in correct) / len(correct)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per problem: 1, 2, 4, ... below n, and n."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]
