"""Planted exploits for tests/test_hacking.py: custom reward functions (custom_reward_function) that pay
for what the task does not want, so a short real run learns to game them."""


def pays_for_length(data_source, solution_str, ground_truth, extra_info=None):
    """One point per 10 characters: the policy learns to stop emitting EOS and runs to the length limit."""
    return len(solution_str) / 10


def pays_for_repeats(data_source, solution_str, ground_truth, extra_info=None):
    """Up to 5 points for repeating itself: 5 x the share of the response's character 3-grams that repeat an
    earlier one (the degenerate check's measure, on characters rather than tokens)."""
    grams = [solution_str[i:i + 3] for i in range(len(solution_str) - 2)]
    return 5 * (1 - len(set(grams)) / len(grams)) if grams else 0.0
