"""simple_grpo/task/rewards.py: correctness by math-verify against the `####` answer, the format check, and
answer_is (correctness in the model's own "The answer is N.")."""
import pytest
import torch

from simple_grpo.task.rewards import correctness_reward, extract_answer, format_reward, score, true_answer

GOOD = "<think>12+7=19\n19-5=14</think><answer>14</answer>"


def test_true_answer_is_the_text_after_hashes():
    assert true_answer("She buys 7: 12+7=<<12+7=19>>19\n#### 19") == "19"
    assert true_answer("...\n#### 1,000") == "1000"


def test_true_answer_without_hashes_is_an_error():
    with pytest.raises(ValueError, match="####"):
        true_answer("the answer is 4")


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


# ---------------------------------------------------------------- named rewards, reward files
from simple_grpo.task.rewards import REWARD_FUNCS, load_reward_file, parse_reward_spec, reward_function  # noqa: E402


@pytest.fixture
def registry():
    """REWARD_FUNCS as it was before the test: tests that register rewards leave no trace."""
    saved = dict(REWARD_FUNCS)
    yield REWARD_FUNCS
    REWARD_FUNCS.clear()
    REWARD_FUNCS.update(saved)


def test_correctness_and_format_are_built_in():
    assert REWARD_FUNCS["correctness"] is correctness_reward and REWARD_FUNCS["format"] is format_reward


def test_the_decorator_registers_by_given_or_own_name(registry):
    @reward_function("shout")
    def loud(completion, answer):
        return float(completion.isupper())

    @reward_function
    def brevity(completion, answer):
        return -len(completion) / 100

    assert registry["shout"] is loud and registry["brevity"] is brevity
    assert loud("HI", "1") == 1.0  # the decorator returns the function itself
    assert score("HI", "1", {"shout": 2.0, "brevity": 1.0})["reward"] == pytest.approx(2.0 - 0.02)


def test_parse_reward_spec_pairs_names_with_weights():
    assert parse_reward_spec("correctness,format", "1.0,0.5") == {"correctness": 1.0, "format": 0.5}
    assert parse_reward_spec(" correctness , format ", " 2, -1e-1 ") == {"correctness": 2.0, "format": -0.1}
    assert parse_reward_spec("format", "") == {"format": 1.0}


@pytest.mark.parametrize("names, weights, message", [
    ("correctness,lenght", "1,1",
     r"unknown reward function\(s\) \['lenght'\]; known: \['answer_is', 'correctness', 'format'"),
    ("correctness,format", "1.0", r"2 reward functions .* but 1 weights"),
    ("correctness", "1,2", r"1 reward functions .* but 2 weights"),
    ("correctness,format", "1,half", "reward weights must be numbers, got '1,half'"),
    ("correctness", "nan", "finite"),
    ("", "", "no reward functions named"),
    ("format,format", "1,1", "named twice"),
])
def test_parse_reward_spec_errors_say_what_is_wrong(names, weights, message):
    with pytest.raises(ValueError, match=message):
        parse_reward_spec(names, weights)


def test_a_reward_file_adds_rewards_that_score_weights(registry, tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("from simple_grpo.task.rewards import reward_function\n\n"
                    "@reward_function('length_penalty')\n"
                    "def length_penalty(completion, answer):\n"
                    "    return -len(completion) / 1000\n")
    assert load_reward_file(str(path)) == ["length_penalty"]
    weights = parse_reward_spec("correctness,format,length_penalty", "1.0,0.5,10")
    out = score(GOOD, "14", weights)
    assert out["length_penalty"] == -len(GOOD) / 1000
    assert out["reward"] == pytest.approx(1.0 + 0.5 - 10 * len(GOOD) / 1000)


def test_score_always_reports_correctness_and_format(registry):
    registry["one"] = lambda completion, answer: 1.0
    assert score(GOOD, "15", {"one": 3.0}) == {"correctness": 0.0, "format": 1.0, "one": 1.0, "reward": 3.0}


@pytest.mark.parametrize("source, error, message", [
    ("def f(:\n", ImportError, r"broken\.py failed to load: SyntaxError"),
    ("raise RuntimeError('no GPU')\n", ImportError, r"broken\.py failed to load: RuntimeError: no GPU"),
    ("def helper(completion, answer):\n    return 1.0\n", ValueError, r"broken\.py registers no reward functions"),
])
def test_a_broken_reward_file_is_an_error_naming_it(registry, tmp_path, source, error, message):
    path = tmp_path / "broken.py"
    path.write_text(source)
    with pytest.raises(error, match=message):
        load_reward_file(str(path))


def test_a_reward_file_with_the_old_import_is_told_the_new_one(registry, tmp_path):
    path = tmp_path / "old_rewards.py"
    path.write_text("from rewards import reward_function\n")
    with pytest.raises(ImportError, match=r"old_rewards\.py: `from rewards import reward_function` is now "
                                          r"`from simple_grpo\.task\.rewards import reward_function`"):
        load_reward_file(str(path))


def test_a_missing_reward_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward file .*nope.py not found"):
        load_reward_file(str(tmp_path / "nope.py"))


@pytest.mark.parametrize("fn, error, message", [
    (lambda completion, answer: 1 / 0, RuntimeError, "reward function 'bad' raised ZeroDivisionError"),
    (lambda completion, answer: "1.0", TypeError, r"reward function 'bad' returned '1.0'; it must return a finite number"),
    (lambda completion, answer: float("nan"), TypeError, "reward function 'bad' returned nan"),
])
def test_a_reward_that_raises_or_returns_no_number_is_named(registry, fn, error, message):
    registry["bad"] = fn
    with pytest.raises(error, match=message):
        score(GOOD, "14", {"bad": 1.0})


def test_score_rejects_an_unknown_reward_name():
    with pytest.raises(ValueError, match=r"unknown reward function\(s\) \['nope'\]"):
        score(GOOD, "14", {"nope": 1.0})


# ---------------------------------------------------------------- answer_is: "The answer is N."
from simple_grpo.rollouts import rollout_stats, score_groups  # noqa: E402
from simple_grpo.task.rewards import answer_is_reward, extract_stated_answer, pick_accuracy_reward  # noqa: E402

WORKED = "Tom starts with 3 apples and buys 4 more.\n3 + 4 = 7\n\nThe answer is 7."


@pytest.mark.parametrize("completion, stated", [
    (WORKED, "7"),
    ("So she pays 4 * $250 = $1,000.\nThe answer is $1,000.", "1000"),
    ("The answer is $42", "42"),
    ("The answer is $42.", "42"),
    ("**The answer is: 42**", "42"),
    ("The final answer is 42", "42"),
    ("THE ANSWER IS 42.", "42"),
    ("The answer is 3.50.", "3.50"),
    ("The answer is -4.", "-4"),
    ("The answer is **1,000** dollars.", "1000"),
])
def test_the_number_right_after_answer_is_is_the_stated_answer(completion, stated):
    assert extract_stated_answer(completion) == stated


@pytest.mark.parametrize("completion", [
    "3 + 4 = 7. So Tom has 7 apples.",  # no phrase
    "<think>3+4=7</think><answer>7</answer>",  # the tags are correctness's, not this reward's
    "The answer is that Tom has 7 apples.",  # no number right after the phrase
    "The answer is 7? No: the answer is unclear.",  # the last phrase states no number
    "",
])
def test_no_number_right_after_the_last_answer_is_states_nothing(completion):
    assert extract_stated_answer(completion) is None
    assert answer_is_reward(completion, "7") == 0.0


@pytest.mark.parametrize("completion, gold", [
    (WORKED, "7"), ("The answer is $1,000.", "1000"), ("The answer is 3.50.", "3.5"), ("The answer is -4.", "-4"),
    ("**The answer is: 42**", "42"), ("The final answer is 42", "42"), ("the answer is $42", "42"),
])
def test_a_right_stated_answer_earns_answer_is(completion, gold):
    assert answer_is_reward(completion, gold) == 1.0


def test_only_the_last_answer_is_counts():
    text = "The answer is 12. Wait, let me check: 5 + 9 = 14. The answer is 14."
    assert answer_is_reward(text, "14") == 1.0
    assert answer_is_reward(text, "12") == 0.0


def test_the_right_number_mentioned_before_a_wrong_final_answer_earns_nothing():
    # what a reward for any mention of the right number (tests/signal_rewards.py) would pay for
    text = "Tom has 7 apples. He gives 2 away: 7 - 2 = 5.\nThe answer is 5."
    assert answer_is_reward(text, "7") == 0.0


def test_only_the_first_number_after_the_phrase_counts():
    assert answer_is_reward("The answer is 6 or 7.", "7") == 0.0
    assert answer_is_reward("The answer is 10 (it is not 7).", "7") == 0.0


def test_answer_is_is_registered_and_scores_beside_correctness_and_format():
    assert REWARD_FUNCS["answer_is"] is answer_is_reward
    assert parse_reward_spec("answer_is") == {"answer_is": 1.0}
    assert score(WORKED, "7", {"answer_is": 1.0}) == {"correctness": 0.0, "format": 0.0, "answer_is": 1.0,
                                                      "reward": 1.0}


def test_the_logged_accuracy_is_the_correctness_reward_trained_on():
    assert pick_accuracy_reward({"correctness": 1.0, "format": 0.5}) == "correctness"
    assert pick_accuracy_reward({"answer_is": 1.0}) == "answer_is"
    assert pick_accuracy_reward({"format": 1.0}) == "correctness"
    # a group of 4 completions to one problem, "7" right: the trainers' log of it
    texts = [WORKED, "The final answer is 7", "The answer is 8.", "<think>3+4=7</think><answer>7</answer>"]
    weights = {"answer_is": 1.0}
    rewards, scores = score_groups(texts, [{"question": "q", "answer": "3 + 4 = 7\n#### 7"}], 4, weights)
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    mask, has_signal, truncated = torch.ones(4, 5), torch.tensor([True]), torch.zeros(4, dtype=torch.bool)
    stats = rollout_stats(rewards, scores, mask, has_signal, 1.0, truncated, pick_accuracy_reward(weights))
    assert stats["accuracy"] == 0.5 and stats["reward_answer_is"] == 0.5
    assert rollout_stats(rewards, scores, mask, has_signal, 1.0, truncated)["accuracy"] == 0.25  # the tags' rate


# ---------------------------------------------------------------- strict: a plain integer in the tags
from simple_grpo.task.rewards import strict_integer_correct  # noqa: E402


def test_an_expression_is_correct_for_math_verify_but_not_strict():
    assert correctness_reward("<answer>21+29</answer>", "50") == 1.0
    assert strict_integer_correct("<answer>21+29</answer>", "50") == 0.0


@pytest.mark.parametrize("predicted, gold", [
    ("50", "50"), (" 50 ", "50"), ("\n50\n", "50"), ("-7", "-7"), ("1,000", "1000"),
    ("1000", "1000"), ("1,234,567", "1234567"), ("050", "50"),
])
def test_a_plain_integer_equal_to_the_true_answer_is_strict_correct(predicted, gold):
    assert strict_integer_correct(f"<think>x</think><answer>{predicted}</answer>", gold) == 1.0


@pytest.mark.parametrize("predicted", [
    "50.0", "$50", "50 apples", "50.", "5e1", "100/2", "\\boxed{50}", "10,00", "5,0", "- 50", "+50", "５０", "",
])
def test_anything_but_a_plain_integer_is_not_strict_correct(predicted):
    """A decimal, a unit or currency sign, an expression, LaTeX, misplaced commas, a plus sign, non-ASCII digits:
    math-verify takes some of these as 50 ("50.0", "$50", "50 apples", "100/2", "- 50"); the strict score none."""
    assert strict_integer_correct(f"<think>x</think><answer>{predicted}</answer>", "50") == 0.0


def test_strict_reads_the_last_tagged_answer_and_needs_one():
    assert strict_integer_correct("<answer>3</answer><answer>50</answer>", "50") == 1.0
    assert strict_integer_correct("<answer>50</answer><answer>3</answer>", "50") == 0.0
    assert strict_integer_correct("The answer is 50.", "50") == 0.0  # no tags, no credit
    assert strict_integer_correct("<answer>51</answer>", "50") == 0.0
    assert strict_integer_correct("<answer>-50</answer>", "50") == 0.0


def test_a_true_answer_that_is_no_integer_is_strict_correct_for_nothing():
    assert strict_integer_correct("<answer>3.5</answer>", "3.5") == 0.0
    assert correctness_reward("<answer>3.5</answer>", "3.5") == 1.0


def test_strict_is_not_a_reward_to_train_on():
    assert "strict" not in REWARD_FUNCS and strict_integer_correct not in REWARD_FUNCS.values()
