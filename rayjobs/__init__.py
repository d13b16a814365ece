"""KubeRay manifests for rayline: rendering helpers and the offline validator (`rayjobs.validate`)."""
