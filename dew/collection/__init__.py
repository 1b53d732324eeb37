"""Collection: what turns a data batch into a training batch on the host.

``sampled_rollout`` (SampledRollout: the native generator inside the trainer), ``scoring``
(the one path from a draw to a reward), ``sources`` (PromptSource, EnvironmentSource over
any RolloutServer), ``episode_driver`` (the rules every multi-turn episode follows),
``episode_rollout`` (EpisodeRollout: tool episodes inside the trainer) and ``journal``
(EpisodeJournal, their crash-safe record), ``ppo_rollout`` (PPORollout: GAE targets over
episodes), ``flow_rollout`` (FlowRollout), ``tasks`` (batch -> Task converters),
``scheduler`` (RolloutScheduler and its admission) with ``bookkeeping`` (what it keeps per
call), ``agreement`` (where the schedulers of several trainer processes meet) and
``streams`` (the read-ahead training stream), and ``harbor_source`` (HarborSource). The
spec imports these names through :mod:`dew.objectives.rl`; the project imports them here.
"""
