"""Online serving: the OpenAI app on Ray Serve LLM, its engines, adapters, API keys and traffic split."""
