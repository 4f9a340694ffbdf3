"""Data-parallel replicas on Ray Serve; multilora.server.ray_serve describes the whole."""
