"""A worker process for the crash test: the real Service with the stand-in engine, settings from
the environment. The test SIGKILLs it mid-stream."""

from __future__ import annotations

import asyncio
import os

from opentelemetry.sdk.trace import TracerProvider

from pipeline.service import Service
from pipeline.settings import load_settings
from pipeline.telemetry import setup_telemetry
from tests.pipeline.fakes import ScriptedEngine


async def main() -> None:
    settings = load_settings()
    engine = ScriptedEngine(delay_s=float(os.environ["SCRIPTED_DELAY_S"]))
    service = Service(settings, engine, setup_telemetry(settings, TracerProvider()))
    await service.run(asyncio.Event())


if __name__ == "__main__":
    asyncio.run(main())
