"""Confinement: running a child in isolation (``isolate``) with its environment (``environment``),
kernel confinement (``sandbox``: namespaces, Landlock), limits (``limits``), its scratch directory
(``scratch_tree``), private compile caches (``compile_caches``), the device's timing lease
(``lease``) and the warm fork server (``zygote``).
"""
