/*
 * Preload library for ranks on a host whose name does not resolve.
 *
 * Horovod 0.28.1's Gloo controller looks up gethostname() to make the
 * device of each process set and crashes when the lookup fails. Under this
 * library gethostname() answers "localhost", so a single-host job binds to
 * loopback. hvd_train/distributed/hostname.py loads it (LD_PRELOAD) only in that case;
 * launch/install.sh builds it into the environment.
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

int gethostname(char *name, size_t len) {
  static const char loopback[] = "localhost";
  if (len < sizeof loopback) {
    errno = ENAMETOOLONG;
    return -1;
  }
  memcpy(name, loopback, sizeof loopback);
  return 0;
}
