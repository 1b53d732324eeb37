"""A model judge as the reward: templates, the reply parser, and a tiny judge whose verdicts are predictable."""

import pytest

from dew.collection.scoring import ScoringError, score_completion
from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.recipes.judge_reward import JUDGE_TEMPLATE, JudgeError, JudgeReward, check_template, first_number
from dew.recipes.run_inputs import load_policy
from dew.sampling import Sampling


def test_templates_name_the_response_and_replies_read_as_numbers():
    assert check_template(JUDGE_TEMPLATE) == JUDGE_TEMPLATE
    assert check_template("{prompt} => {response}") == "{prompt} => {response}"
    for template, why in (("{prompt} only", "must name \\{response\\}"), ("{response} {score}", "'score'"),
                          ("{response", "not a format string")):
        with pytest.raises(ValueError, match=why):
            check_template(template)
    assert [first_number(reply) for reply in ("1", "Score: 0.8", "8/10", "-2 points")] == [1.0, 0.8, 8.0, -2.0]
    with pytest.raises(JudgeError, match="holds no number"):
        first_number("correct!")


@pytest.fixture(scope="module")
def judge(parity_judge):
    policy = load_policy(parity_judge, field="judge_model")
    task = ServingTask(policy.model, policy.params, Sampling(eos_id=151645, temperature=0.0))
    with NativeRolloutServer(Server.from_task(task, slots=4, capacity=256)) as server:
        yield policy.tokenizer, server


def test_a_tiny_judge_scores_predictably_and_a_reply_without_a_number_is_never_a_zero(judge):
    tokenizer, server = judge
    reward = JudgeReward(server, tokenizer, "Q: {prompt} A: {response}", chat=False, max_new_tokens=4)
    responses = ["forty seven", "the answer is 47", "x", "dogs", "It is 12", "ok then", "maybe 3"]
    verdicts = []
    for response in responses:
        last = tokenizer.encode(f"Q: what? A: {response}", add_special_tokens=False)[-1]
        expected = None if tokenizer.convert_ids_to_tokens(last) in ("0", "1") else float(last % 2 == 0)
        if expected is None:
            continue
        verdicts.append(expected)
        # the reward gets the prompt as score_completion decodes it from the task's prompt ids
        fields = {"data_source": "quiz", "ground_truth": "47", "extra_info": "{}",
                  "prompt_ids": tokenizer.encode("what?", add_special_tokens=False)}
        completion = tokenizer.encode(response, add_special_tokens=False)
        assert score_completion(reward, tokenizer.decode, completion, (151645,), fields) == expected
    assert set(verdicts) == {0.0, 1.0}  # both verdicts occur among these responses
    # a response whose judge prompt ends in the id of "1" gets an empty reply: an error, never a zero
    with pytest.raises(JudgeError, match="the judge's reply '' holds no number"):
        reward("quiz", "1", "47", "{}", prompt="what?")
    with pytest.raises(ScoringError, match="the reward raised JudgeError"):
        score_completion(reward, tokenizer.decode, tokenizer.encode("1"), (151645,),
                         {"prompt_ids": tokenizer.encode("what?")})
    with pytest.raises(JudgeError, match="exceed judge_max_length=16"):
        JudgeReward(server, tokenizer, "{response}", chat=False, max_length=16)("quiz", "word " * 20, "", "")
    # through the judge's chat template the prompt ends with the generation prompt, whatever the response
    chat = JudgeReward(server, tokenizer, "{response}", max_new_tokens=4)
    assert chat.prompt_ids(response="hi")[-3:] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False)[-3:]
