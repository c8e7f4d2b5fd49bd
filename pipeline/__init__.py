"""The service: Kafka in and out, the analysis loop, HTTP status, telemetry, settings and the CLI."""
