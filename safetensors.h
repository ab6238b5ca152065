// safetensors.h — the checkpoint reader (placeholder).
#pragma once
