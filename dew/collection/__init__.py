"""Collection: what turns a data batch into a training batch on the host.

``rollout`` (SampledRollout: the native generator inside the trainer), ``scoring`` (the
one path from a draw to a reward), ``sources`` (PromptSource, EnvironmentSource over any
RolloutServer), ``tasks`` (batch -> Task converters), ``scheduler`` (RolloutScheduler and
its admission), ``agreement`` (where the schedulers of several trainer processes meet)
``streams`` (the read-ahead training stream), ``episodes`` (EpisodeRollout: tool episodes
inside the trainer) and ``journal`` (EpisodeJournal, their crash-safe record). PPORollout
and FlowRollout belong here too. The spec's import path for all of it is
:mod:`dew.objectives.rl`.
"""
