"""Records and packing: engine-sourced calls and sessions, the episode protocol, and ``pack``.

``sessions`` (Call, Session, Status, Task, SessionSource), ``actions`` (the one validator
of model actions), ``episodes`` (EpisodeId, Observation, Action, Transition, Episode,
Environment), ``episode_sessions`` (EpisodeRecord, ActionRecord, session_of), ``packing`` (pack, chain_lengths, rows_needed), ``metrics``
(session_metrics) and ``verl`` (to_verl, from_verl: sessions as verl rows and back). Records import only pure math (:mod:`dew.losses`) and the validators;
the spec reaches them as :mod:`dew.objectives.rl.sessions`.
"""
