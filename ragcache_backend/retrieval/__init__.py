"""Retrieval: corpus chunking, the MiniLM embedder, the Faiss document store and its file format."""
