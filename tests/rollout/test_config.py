"""The ``rollout:`` section's checks that read other sections too."""

import pytest

from mmrl.errors import ConfigError
from mmrl.rollout.config import RolloutConfig, check_refill_rounds


def test_refill_rounds_run_in_the_learner_process_or_one_scoring_worker_beside_one_learner_process():
    check_refill_rounds(RolloutConfig(workers=0), 2, learner_processes=4)
    check_refill_rounds(RolloutConfig(workers=1), 2)
    check_refill_rounds(RolloutConfig(workers=3, score_on="learner"), 0, learner_processes=2)  # no refill rounds: nothing to refuse


@pytest.mark.parametrize(
    "rollout, processes, field, says",
    [
        (RolloutConfig(workers=2), 1, "rollout.workers", "decide over one worker's groups"),
        (RolloutConfig(workers=1), 2, "rollout.workers", "all 2 learner processes' groups"),
        (RolloutConfig(workers=1, score_on="learner"), 1, "rollout.score_on", "score while they sample"),
    ],
)
def test_refill_rounds_that_worker_processes_cannot_run_are_refused_naming_the_field(rollout, processes, field, says):
    with pytest.raises(ConfigError) as e:
        check_refill_rounds(rollout, 2, learner_processes=processes)
    assert e.value.field == field and says in str(e.value)
