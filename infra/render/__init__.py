"""What the VMs run, rendered: render.py and the startup-script templates."""
