"""The library every stage uses: configs, storage, the MLflow registry, metrics, Ray connection, secrets."""
