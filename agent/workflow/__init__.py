"""The LangGraph workflow of SPEC §2: state, graph, nodes, and running it (checkpoints, --resume)."""
