/* A stand-in for NVIDIA's libnvidia-ml.so.1 on a machine without a GPU (the real-node tier): the few entry points the
 * node agent calls through nvidia-ml-py (pynvml) to list the node's GPUs, with NVML's own signatures and return
 * codes, so the agent's real code path (ctypes loading the library by its soname) runs unchanged.
 *
 * The GPUs are the UUIDs in $BUBBLES_FAKE_NVML_UUIDS, comma-separated, in index order ("" or unset: no device). A
 * UUID longer than the caller's buffer is NVML_ERROR_INSUFFICIENT_SIZE, an index past the count
 * NVML_ERROR_INVALID_ARGUMENT, a call before nvmlInit NVML_ERROR_UNINITIALIZED, as NVML answers them: the agent
 * handling them wrongly fails here as it would on a GPU node.
 *
 * Built by tests/helpers/fake_nvml.py with the host's C compiler; never shipped (a test helper, not a product part).
 */
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_DEVICES 16
#define MAX_UUID 96

struct fake_device {
    char uuid[MAX_UUID];
};

static struct fake_device devices[MAX_DEVICES];
static unsigned int count;
static int initialized;

static void load(void) {
    const char *env = getenv("BUBBLES_FAKE_NVML_UUIDS");
    count = 0;
    if (env == NULL) {
        return;
    }
    const char *p = env;
    while (*p != '\0' && count < MAX_DEVICES) {
        const char *end = strchr(p, ',');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n > 0 && n < MAX_UUID) {
            memcpy(devices[count].uuid, p, n);
            devices[count].uuid[n] = '\0';
            count++;
        }
        if (end == NULL) {
            break;
        }
        p = end + 1;
    }
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    load();
    initialized++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (initialized == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (initialized == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (deviceCount == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *deviceCount = count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (initialized == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (device == NULL || index >= count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (initialized == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (device == NULL || uuid == NULL || device < devices || device >= devices + count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(device->uuid) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    strcpy(uuid, device->uuid);
    return NVML_SUCCESS;
}
