"""An out-of-tree platform: a CPU variant, active wherever it is installed."""

import os

from asyncengine.plugins_api import Platform


class CpuVariant(Platform):
    device_name = "cpu_b"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def get_device_total_memory(cls, device):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def detect():
    return "ae_plugin_platform_b:CpuVariant"
