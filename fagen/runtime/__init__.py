"""Runtime: the content-addressed cache, module import, load, prebuilt cubins, device choice, fagen.attention."""
