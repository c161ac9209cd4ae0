"""Code generation: fagen.codegen.render.render(spec) -> Rendered, through the Jinja templates in fagen/templates/."""
