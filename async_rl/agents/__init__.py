"""Agents written for the OpenAI client, trained or served through an OpenAI-compatible
endpoint: the wire format (`wire`), the endpoint (`server`), an episode's assembly
(`episode`) and the agent task (`task`)."""
