"""Where programs run: our server over HTTP (`RuntimeEndpoint`, `Runtime`), the in-process Engine
(`EngineBackend`), or any OpenAI-compatible server (`OpenAI`)."""
