"""`python -m eqc_utils.serving --config <serve yaml>`: the proxy in front of vLLM (docs/serving.md).

    python -m eqc_utils.serving --config configs/serve/paper_dflash.yaml --port 8080
    python -m eqc_utils.serving --config tiny_ar --set vllm_args.max_model_len=2048 --set proxy.max_restarts=0

Environment fallbacks: EQC_CONFIG_PATH (--config), EQC_HOST (--host), EQC_PORT (--port).
The proxy binds 127.0.0.1 unless --host says otherwise (0.0.0.0 exposes it on every interface).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from eqc_utils.params import ParamsError, parse_override
from eqc_utils.serving.config import ServeConfigError, load_serve_config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eqc_utils.serving", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.environ.get("EQC_CONFIG_PATH"),
                        help="serve YAML, or the name of one in configs/serve/ (env EQC_CONFIG_PATH)")
    parser.add_argument("--host", default=os.environ.get("EQC_HOST", "127.0.0.1"),
                        help="address to bind (default 127.0.0.1; env EQC_HOST)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("EQC_PORT", "8080")),
                        help="port to bind (default 8080; env EQC_PORT)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, dotted, YAML-parsed (repeatable), "
                             "e.g. --set vllm_args.gpu_memory_utilization=0.30")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if not args.config:
        parser.error("--config is required (or set EQC_CONFIG_PATH)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = dict(parse_override(text) for text in args.set)
        config = load_serve_config(args.config, overrides)
    except (ServeConfigError, ParamsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import uvicorn
    from eqc_utils.serving.proxy import create_app

    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
        timeout_graceful_shutdown=int(config.proxy["graceful_shutdown"])))
    logging.getLogger("eqc.serving").info(
        "serving %s (%s) on http://%s:%d", config.served_model_name, config["name"] or args.config, args.host, args.port)
    try:
        server.run()
    finally:
        app.state.backend.stop()      # already done on a normal shutdown; this covers startup failures
    return 0 if app.state.backend.state != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
