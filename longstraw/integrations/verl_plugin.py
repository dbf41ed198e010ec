"""Train verl's actor through LongStraw with a config change alone.

verl imports `actor_rollout_ref.model.external_lib` in every worker before
it builds the engines; importing this module calls
`longstraw.integrations.verl.register` there, with LongStraw's options
from the `LONGSTRAW_OPTIONS` environment variable (JSON; pass it to the
workers through Ray's runtime environment):

    LONGSTRAW_OPTIONS='{"prompt_grad": "exact"}' python -m verl.trainer.main_ppo \\
        actor_rollout_ref.model.external_lib=longstraw.integrations.verl_plugin \\
        actor_rollout_ref.actor.strategy=fsdp2 \\
        actor_rollout_ref.model.enable_gradient_checkpointing=False ...
"""

from __future__ import annotations

import json
import os

from longstraw.integrations.verl import register

register(json.loads(os.environ.get("LONGSTRAW_OPTIONS") or "{}"))
