"""rewards.py: correctness by math-verify against the `####` answer, and the format check."""
import pytest

from rewards import correctness_reward, extract_answer, format_reward, reference_answer, score

GOOD = "<think>12+7=19\n19-5=14</think><answer>14</answer>"


def test_reference_answer_is_the_text_after_hashes():
    assert reference_answer("She buys 7: 12+7=<<12+7=19>>19\n#### 19") == "19"
    assert reference_answer("...\n#### 1,000") == "1000"


def test_reference_answer_without_hashes_is_an_error():
    with pytest.raises(ValueError, match="####"):
        reference_answer("the answer is 4")


@pytest.mark.parametrize("predicted, gold", [
    ("1,000", "1000"), ("1000", "1,000"), ("3.50", "3.5"), ("-7", "-7"), ("7/2", "3.5"),
    ("\\frac{7}{2}", "3.5"), ("$\\frac{1}{2}$", "0.5"), ("14 apples", "14"), (" 14 ", "14"),
])
def test_equal_answers_in_other_notations_are_correct(predicted, gold):
    assert correctness_reward(f"<think>x</think><answer>{predicted}</answer>", gold) == 1.0


@pytest.mark.parametrize("predicted, gold", [("15", "14"), ("-7", "7"), ("3.51", "3.5"), ("1/3", "0.33")])
def test_different_answers_are_wrong(predicted, gold):
    assert correctness_reward(f"<think>x</think><answer>{predicted}</answer>", gold) == 0.0


@pytest.mark.parametrize("completion", [
    "", "14", "The answer is 14.", "<think>12+2=14</think>14", "<think>14</think> answer: 14",
    "<answer></answer>", "<answer>abc</answer>", "<answer>14", "14</answer>",
])
def test_no_tagged_answer_gets_no_credit(completion):
    assert correctness_reward(completion, "14") == 0.0


def test_the_last_tagged_answer_counts():
    assert extract_answer("<answer>3</answer><answer>14</answer>") == "14"
    assert correctness_reward("<answer>3</answer><answer>14</answer>", "14") == 1.0
    assert correctness_reward("<answer>14</answer><answer>3</answer>", "14") == 0.0


def test_format_accepts_think_then_answer():
    assert format_reward(GOOD) == 1.0
    assert format_reward("  <think> a </think>\n<answer> 14 </answer>\n") == 1.0


@pytest.mark.parametrize("completion", [
    "",  # empty output
    "<answer>14</answer>",  # no think
    "<think>x</think>",  # no answer
    "<think>x</think>The answer is 14.",  # answer outside the tags
    "<think>x</think><answer>14</answer> so 14",  # text after the answer
    "So: <think>x</think><answer>14</answer>",  # text before the think
    "<answer>14</answer><think>x</think>",  # wrong order
    "<think>x</think><think>y</think><answer>14</answer>",  # doubled think
    "<think>x</think><answer>14</answer><answer>14</answer>",  # doubled answer
    "<think>x<answer>1</answer></think><answer>14</answer>",  # nested tags
    "<think>x</think><answer>14",  # unclosed
])
def test_format_rejects_missing_doubled_or_misplaced_tags(completion):
    assert format_reward(completion) == 0.0


def test_score_sums_weighted_rewards():
    assert score(GOOD, "14") == {"correctness": 1.0, "format": 1.0, "reward": 1.5}
    assert score("<answer>14</answer>", "14")["reward"] == 1.0
    assert score(GOOD, "15", weights={"correctness": 2.0, "format": 1.0})["reward"] == 1.0


def test_rewards_work_off_the_main_thread():
    # math-verify's time limit uses SIGALRM, which only the main thread may set
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(correctness_reward, GOOD, "14").result() == 1.0
