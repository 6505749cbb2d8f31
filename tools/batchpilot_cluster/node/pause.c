/* The pod sandbox's process for the e2e node: it holds the Pod's namespaces open, reaps the
 * zombies of containers that share its PID namespace, and exits on SIGINT or SIGTERM. It is
 * the job of Kubernetes' build/pause/linux/pause.c, written again here because no registry is
 * reachable to pull registry.k8s.io/pause, and built static so the image needs nothing else. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signal_number) {
  (void)signal_number;
  _exit(0);
}

static void reap(int signal_number) {
  (void)signal_number;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
      sigaction(SIGCHLD, &on_child, NULL) < 0) {
    return 1;
  }
  for (;;) {
    pause();
  }
}
