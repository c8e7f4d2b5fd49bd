"""A worker process for the crash tests: the real Service with the stand-in engine, settings from
the environment. Tests SIGKILL it mid-stream, or SIGTERM it for a graceful stop (exit 0). Logging
is set up as the CLI sets it up, so what it writes to stderr is what a production worker writes."""

from __future__ import annotations

import asyncio
import os

from opentelemetry.sdk.trace import TracerProvider

from pipeline.logs import setup_logging
from pipeline.service import Service
from pipeline.settings import load_settings
from pipeline.telemetry import setup_telemetry
from pipeline.workers import stop_on_signals
from tests.pipeline.fakes import ScriptedEngine


async def main() -> None:
    settings = load_settings()
    setup_logging(settings.log_level)
    engine = ScriptedEngine(delay_s=float(os.environ["SCRIPTED_DELAY_S"]))
    service = Service(settings, engine, setup_telemetry(settings, TracerProvider()))
    await service.run(stop_on_signals())


if __name__ == "__main__":
    asyncio.run(main())
