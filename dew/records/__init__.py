"""Records and packing: engine-sourced calls and sessions, the episode protocol, and ``pack``.

``session_records`` (Call, Session, Status, Task, SessionSource), ``actions`` (the one
validator of model actions), ``episode_protocol`` (EpisodeId, Observation, Action,
Transition, Episode, Environment), ``episode_records`` (EpisodeRecord, ActionRecord,
session_of), ``session_packing`` (pack, chain_lengths, rows_needed), ``session_metrics``
and ``verl_rows`` (to_verl, from_verl: sessions as verl rows and back). Records import
only pure math (:mod:`dew.losses`) and the validators; the spec reaches them as
:mod:`dew.objectives.rl.sessions`.
"""
