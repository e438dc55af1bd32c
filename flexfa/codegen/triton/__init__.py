"""The Triton backend: IR -> device functions (`emit`), kernel templates (`templates/`), module
rendering and caching (`module`), configs (`configs`) and the backend itself (`backend`)."""
