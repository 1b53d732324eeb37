"""The spec's ``dew.objectives.rl.harbor``: HarborSource and what it needs, re-exported from their layers.

HarborSource is a collector (:mod:`dew.collection.harbor_source`) and the gateway and its proxy are
inference-side components (:mod:`dew.inference.gateway`, :mod:`dew.inference.session_proxy`);
this module is the path the spec imports them from.
"""

from dew.collection.harbor_source import HarborCLI, HarborSource, Trial, TrialOutcome, outcome_of, trace_call
from dew.inference.gateway import Gateway, GatewayError
from dew.inference.session_proxy import SessionProxy

__all__ = ["Gateway", "GatewayError", "HarborCLI", "HarborSource", "SessionProxy", "Trial", "TrialOutcome",
           "outcome_of", "trace_call"]
